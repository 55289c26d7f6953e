"""The continuous batching engine: outputs independent of batching, stop conditions, sampling options,
preemption, aborts, and no compilation after warm-up."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from conftest import hf_greedy, small_engine_options

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts_of_mixed_lengths(tok, count: int = 10) -> list[list[int]]:
    base = tok("Once upon a time in a small village by the sea, there lived an old fisherman who "
               "told stories about storms, whales, and the lights that danced over the water at night.").input_ids
    rng = np.random.default_rng(0)
    return [base[: int(n)] for n in rng.integers(2, len(base), count)]


@pytest.fixture(scope="module")
def llm_default():
    return LLM(**small_engine_options())


@pytest.fixture(scope="module")
def alone(llm_default):
    """Each prompt generated alone: the reference for batched runs."""
    prompts = prompts_of_mixed_lengths(llm_default.get_tokenizer())
    return prompts, [llm_default.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_batched_equals_alone_and_hf(llm_default, alone, hf_default_model):
    prompts, ref = alone
    outs = llm_default.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for p, r in list(zip(prompts, ref))[:3]:
        assert hf_greedy(hf_default_model, p, GREEDY.max_tokens) == r
    llm_default.engine.check_invariants()
    assert llm_default.engine.pool.num_free + llm_default.engine.prefix_cache.cached_pages() == llm_default.engine.num_pages - 1
    assert llm_default.engine.config.dtype == "float32"  # dtype "auto" (the default) on CPU; HF parity above is float32
    assert llm_default.engine.buckets.token_buckets[:4] == (1, 2, 4, 8)  # CPU: a lone decode is a 1-row step


@pytest.mark.parametrize("options", [
    dict(scheduler="static"),
    dict(min_token_bucket=16),  # the accelerators' floor: decodes padded to 16 rows
    dict(max_num_batched_tokens=16, max_num_seqs=4),  # chunked prefill everywhere
    dict(num_pages=12, max_model_len=96, enable_prefix_caching=False),  # preemption by recompute
    dict(num_pages=12, max_model_len=96),  # preemption with the prefix cache evicting first
])
def test_batching_modes_give_identical_greedy_outputs(options, alone):
    prompts, ref = alone
    llm = LLM(**small_engine_options(**options))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    if options.get("num_pages") == 12:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()


def test_no_compilation_after_warmup():
    llm = LLM(**small_engine_options(compile_ahead=True, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128))
    tok = llm.get_tokenizer()
    rng = np.random.default_rng(3)
    text = "the quick brown fox jumps over the lazy dog and keeps running far away " * 4
    ids = tok(text).input_ids
    for batch in (1, 3, 8, 11):
        prompts = [ids[: int(n)] for n in rng.integers(1, 80, batch)]
        params = [SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=float(rng.choice([0.0, 0.8])),
                                 top_k=int(rng.choice([-1, 5])), top_p=float(rng.choice([1.0, 0.9])),
                                 repetition_penalty=float(rng.choice([1.0, 1.2])), seed=int(rng.integers(100)),
                                 logprobs=int(rng.choice([0, 3])), min_tokens=int(rng.choice([0, 1])))
                  for _ in prompts]
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.compiles_after_warmup == 0


def test_a_persistent_cache_hit_counts_as_a_compile():
    """The warm-up check must see a shape warm-up missed even when the persistent cache (here the
    test run's own, conftest) holds it from an earlier engine: jit then reads it instead of
    compiling, and jax reports that read as a backend compile too, which CompileCounter counts."""
    import jax
    import jax.numpy as jnp

    from jaxserve.engine.runner import CompileCounter

    assert jax.config.jax_compilation_cache_dir, "conftest sets a persistent cache for the run"
    CompileCounter.install()
    x = jnp.arange(37, dtype=jnp.float32)  # a shape no other test compiles this function for
    before = CompileCounter.count
    jax.jit(lambda v: jnp.sin(v) * 7.5 + 1.0)(x).block_until_ready()  # compiled, or read if cached
    jax.clear_caches()
    jax.jit(lambda v: jnp.sin(v) * 7.5 + 1.0)(x).block_until_ready()  # read from the cache
    assert CompileCounter.count - before == 2


def test_stop_conditions(llm_default):
    tok = llm_default.get_tokenizer()
    prompt = "The capital of France is"
    free = llm_default.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    # Stop string: matched on text, never emitted.
    word = free.text.split()[2]
    out = llm_default.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop=[word]),
                               use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert word not in out.text and free.text.startswith(out.text)
    # Stop token id.
    stop_id = free.token_ids[4]
    out = llm_default.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_id]),
                               use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    # min_tokens holds the stop id back.
    out = llm_default.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_id],
                                                        min_tokens=10), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 10 and stop_id not in out.token_ids[:9]
    # EOS ends a chat answer unless ignore_eos.
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True)
    chat = list(chat["input_ids"]) if hasattr(chat, "keys") else list(chat)
    out = llm_default.generate([chat], SamplingParams(max_tokens=60, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm_default.engine.eos_token_ids
    out = llm_default.generate([chat], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 60


def test_seed_n_and_logprobs(llm_default):
    prompt = "My favourite colour is"
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = llm_default.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    # Same seed, same output, whatever the batch around it.
    batch = llm_default.generate(["Noise prompt one", prompt, "Another"], [SamplingParams(max_tokens=5, temperature=1.0), p,
                                 SamplingParams(max_tokens=30, temperature=0.7)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == a
    unseeded = {tuple(llm_default.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True),
                                           use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1
    out = llm_default.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=1, ignore_eos=True),
                               use_tqdm=False)[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    g = llm_default.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    lps = g.outputs[0].logprobs
    assert len(lps) == 6
    for tok_id, entry in zip(g.outputs[0].token_ids, lps):
        assert tok_id in entry and len(entry) <= 4
        assert entry[tok_id] == pytest.approx(max(entry.values()), abs=1e-5)  # greedy picks the top one
        assert all(v <= 0 for v in entry.values())


def test_logprobs_match_reference_log_softmax(llm_default, hf_default_model):
    import torch
    from conftest import hf_logits

    prompt = llm_default.get_tokenizer()("The weather today is").input_ids
    out = llm_default.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    ids = list(prompt)
    for tok, entry in zip(out.token_ids, out.logprobs):
        ref = torch.log_softmax(torch.tensor(hf_logits(hf_default_model, ids)[-1]), -1).numpy()
        for t, lp in entry.items():
            assert lp == pytest.approx(float(ref[t]), abs=2e-4)
        assert set(entry) - {tok} <= set(np.argsort(-ref)[:5].tolist())
        ids.append(tok)


def test_top_k_one_is_greedy_and_penalties_change_output(llm_default):
    prompt = "List of fruits: apple, banana,"
    greedy = llm_default.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
    top1 = llm_default.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, top_k=1, seed=3, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
    assert top1 == greedy
    pen = llm_default.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                        repetition_penalty=1.8, frequency_penalty=1.0),
                               use_tqdm=False)[0].outputs[0].token_ids
    assert pen != greedy
    assert len(set(pen)) >= len(set(greedy))


def test_repetition_penalty_matches_hf(llm_default, hf_default_model):
    """Penalties come from per-request state kept on the device (built from a request's history
    once, then advanced by each step): greedy with HF's repetition penalty gives HF's tokens,
    with penalized and plain requests in one batch."""
    tok = llm_default.get_tokenizer()
    prompts = [tok.encode(p) for p in ("List of fruits: apple, banana,", "The capital of France is",
                                       "1, 2, 3, 4,")]
    pen = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm_default.generate(prompts + prompts[:1], [pen] * len(prompts) + [plain], use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_default_model, p, 20, repetition_penalty=1.3)
    assert outs[-1].outputs[0].token_ids == hf_greedy(hf_default_model, prompts[0], 20)
    assert outs[-1].outputs[0].token_ids != outs[0].outputs[0].token_ids  # the penalty mattered
    llm_default.engine.check_invariants()  # every penalty slot back


def test_too_large_requests_are_clear_errors(llm_default):
    with pytest.raises(ValueError, match="prompt"):
        llm_default.generate([list(range(5, 400))], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm_default.generate(["hi"], SamplingParams(max_tokens=1000), use_tqdm=False)
    small = LLM(**small_engine_options(num_pages=4))
    with pytest.raises(ValueError, match="page pool"):
        small.generate(["hi there"], SamplingParams(max_tokens=100), use_tqdm=False)
    small.engine.check_invariants()
    assert not small.engine.has_unfinished()


def test_async_engine_streams_and_abort_frees_pages(llm_default):
    engine = AsyncEngine(engine=llm_default.engine)

    async def run():
        deltas = []
        async for out in engine.generate("Tell me a story about", SamplingParams(max_tokens=12, temperature=0.0)):
            deltas.append(out.delta_text)
            final = out
        assert "".join(deltas) == final.outputs[0].text and final.finished

        gen = engine.generate("A very long answer about", SamplingParams(max_tokens=200, temperature=0.0,
                                                                          ignore_eos=True), request_id="to-abort")
        got = 0
        async for _ in gen:
            got += 1
            if got == 3:
                break
        await gen.aclose()
        for _ in range(200):
            if not llm_default.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not llm_default.engine.has_unfinished()

    try:
        asyncio.run(run())
        llm_default.engine.check_invariants()
    finally:
        engine.shutdown()


class RecordingFollowers:
    """Stands in for distributed.StepBroadcaster: counts what the leader would send."""

    def __init__(self):
        self.steps = self.keep_alives = self.stops = 0

    def send(self, runners, plans) -> None:
        self.steps += 1

    def keep_alive(self) -> None:
        self.keep_alives += 1

    def stop(self) -> None:
        self.stops += 1


def test_multihost_leader_loop_keeps_followers_alive_stops_them_and_dies_on_a_failed_step(llm_default, monkeypatch):
    from jaxserve.engine.async_engine import EngineDeadError

    core = llm_default.engine
    followers = RecordingFollowers()
    monkeypatch.setattr(core, "broadcaster", followers)
    monkeypatch.setattr(core, "multihost", True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def collect(engine):
        return [out async for out in engine.generate("Hello there", params)]

    engine = AsyncEngine(engine=core)
    try:
        outs = asyncio.run(collect(engine))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        assert followers.steps >= 4  # every step was announced
        deadline = time.monotonic() + 5
        while followers.keep_alives == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert followers.keep_alives > 0  # the idle loop offers keep-alives (the broadcaster rate-limits them)
    finally:
        engine.shutdown()
    assert followers.stops == 1  # sent by the engine thread as it ends

    followers = RecordingFollowers()  # stop_followers() dropped the first one
    monkeypatch.setattr(core, "broadcaster", followers)
    fatal = []
    engine = AsyncEngine(engine=core, on_fatal=fatal.append)

    def failing_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(core, "step", failing_step)
    try:
        with pytest.raises(RuntimeError, match="engine step failed: device lost"):
            asyncio.run(collect(engine))
        engine._thread.join(5)
        assert not engine._thread.is_alive() and len(fatal) == 1 and not engine.accepting
        assert str(engine.fatal_error) == "device lost"
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine))
        assert followers.stops == 0  # no STOP after a failed step: the followers may be mid-step
        assert not core.has_unfinished()
        core.check_invariants()
    finally:
        engine.shutdown()


def test_shutdown_fails_requests_still_running(llm_default):
    """Past the grace period the server shuts the engine down: what still runs gets an error, not silence."""
    from jaxserve.engine.async_engine import EngineDeadError

    engine = AsyncEngine(engine=llm_default.engine)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def run():
        gen = engine.generate("A very long answer about", long)
        await gen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in gen:
                pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert not llm_default.engine.has_unfinished()
    llm_default.engine.check_invariants()


def test_step_broadcaster_keep_alive_is_rate_limited(monkeypatch):
    from jaxserve import distributed

    now = [1000.0]
    monkeypatch.setattr(distributed.time, "monotonic", lambda: now[0])
    b = distributed.StepBroadcaster(1, keep_alive_seconds=60)  # one process: the broadcasts return at once
    now[0] += 59
    assert not b.keep_alive()
    now[0] += 2
    assert b.keep_alive() and not b.keep_alive()
    now[0] += 50
    b.send([], [None])  # a step counts as contact too
    now[0] += 20
    assert not b.keep_alive()


@pytest.mark.parametrize("policy, order", [("priority", ["c", "b", "d", "a"]), ("fcfs", ["a", "b", "c", "d"])])
def test_scheduling_policy_orders_waiting_requests(policy, order, tiny_checkpoints):
    """One sequence at a time: under `priority` the lowest value runs first (vLLM's rule), ties by
    arrival; under fcfs, arrival alone."""
    llm = LLM(model=str(tiny_checkpoints["qwen2"]), scheduling_policy=policy, **small_engine_options(max_num_seqs=1))
    engine = llm.engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for request_id, priority in (("a", 5), ("b", 0), ("c", -2), ("d", 0)):
        engine.add_request(request_id, [1, 2, 3, 4], params, priority=priority)
    finished = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == order
    engine.check_invariants()
