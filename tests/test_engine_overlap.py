"""Overlapped scheduling (step N+1 planned and launched before step N's results are read) against
the synchronous engine: the same tokens, text, logprobs and finish reasons for every option a
request can carry, no token past a stop reaching a client, and a clean page pool after aborts."""

from __future__ import annotations

import pytest
from conftest import small_engine_options

from jaxserve import LLM, SamplingParams
from jaxserve.engine.request import RequestStatus

PROMPTS = ["The capital of France is", "Once upon a time", "List three colours:", "My favourite food is",
           "Write a haiku about rain.", "def fibonacci(n):", "The quick brown fox", "In 1969, the first"]


def mixed_params(max_tokens: int = 40) -> list[SamplingParams]:
    """What clients send: the default temperature, nucleus and top-k sampling, penalties (the
    history of a decode planned during the step sampling its input), logprobs, stop strings and
    ids, min_tokens, n > 1 and prompt logprobs, all seeded so that both engines can be compared."""
    return [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, seed=1),  # temperature 1.0, EOS allowed
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=2, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_k=20, repetition_penalty=1.2, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, stop=["\n", " the "]),
        SamplingParams(max_tokens=16, temperature=0.7, n=2, seed=4, min_tokens=8, prompt_logprobs=2),
        SamplingParams(max_tokens=1, temperature=0.0),  # finishes at its first token
    ]


def summary(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted(d.items()) for d in c.logprobs]) for c in o.outputs]
            + [None if o.prompt_logprobs is None else [d and sorted(d.items()) for d in o.prompt_logprobs]]
            for o in outputs]


def close(a, b, tol: float = 1e-4) -> bool:
    """Equal structures, floats within tol: the two engines batch steps differently, so their f32
    logits come from different step shapes (on CPU from 1 row up) and differ in the last digits
    (1.7e-5 seen in a logprob)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def engines():
    return LLM(**small_engine_options()), LLM(**small_engine_options(async_scheduling=False))


@pytest.mark.parametrize("options", [
    {},
    dict(max_num_batched_tokens=16, max_num_seqs=4),  # chunked prefill, decodes beside prompt chunks
    dict(num_pages=12, max_model_len=96),  # preemption while a step is in flight
])
def test_overlap_equals_synchronous_engine(options, engines):
    overlapped, sync = engines
    assert overlapped.engine.overlap and not sync.engine.overlap
    if options:
        overlapped = LLM(**small_engine_options(**options))
        sync = LLM(**small_engine_options(async_scheduling=False, **options))
    params = mixed_params()
    a = overlapped.generate(PROMPTS, params, use_tqdm=False)
    b = sync.generate(PROMPTS, params, use_tqdm=False)
    assert close(summary(a), summary(b))
    stopped = a[5].outputs[0]
    assert stopped.finish_reason in ("stop", "length") and "\n" not in stopped.text
    assert len(a[7].outputs[0].token_ids) == 1
    if options.get("num_pages") == 12:
        assert overlapped.engine.scheduler.num_preemptions > 0
    for llm in (overlapped, sync):
        assert not llm.engine.has_unfinished()
        llm.engine.check_invariants()
        assert all(r.num_pending == 0 for r in llm.engine.scheduler.running)
    assert overlapped.engine.compiles_after_warmup == 0 or not overlapped.engine.config.compile_ahead


def test_streamed_deltas_stop_at_the_finish_and_aborts_free_pages(engines):
    """Step by step: every request's deltas add up to its final output, nothing follows the final
    output (the step in flight when a request stops still computed a row for it), and requests
    aborted while a step that holds them is in flight leave no pages behind."""
    llm, _ = engines
    engine = llm.engine
    tok = llm.get_tokenizer()
    stop_word = " the "
    reqs = {}
    for i, prompt in enumerate(PROMPTS):
        p = SamplingParams(max_tokens=40, temperature=0.8 if i % 2 else 0.0, seed=i,
                           stop=[stop_word] if i % 3 == 0 else None)
        rid = f"r{i}"
        engine.add_request(rid, tok(prompt).input_ids, p)
        reqs[rid] = p
    streamed = {rid: ("", []) for rid in reqs}
    finals = {}
    aborted = set()
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        if steps == 1:
            assert outs == [] and engine._in_flight, "the first step's results are read by the second call"
        for out in outs:
            assert out.request_id not in finals, f"{out.request_id} got an output after its final one"
            text, ids = streamed[out.request_id]
            streamed[out.request_id] = (text + out.delta_text, ids + out.delta_token_ids)
            if out.finished:
                finals[out.request_id] = out
        if steps == 6:  # abort two running requests while step 7 is in flight
            for rid in ("r1", "r2"):
                if rid not in finals and engine.abort(rid):
                    aborted.add(rid)
    assert aborted
    for rid, out in finals.items():
        text, ids = streamed[rid]
        c = out.outputs[0]
        assert text == c.text and ids == c.token_ids
        if reqs[rid].stop:
            assert stop_word not in c.text
    assert set(finals) | aborted == set(reqs)
    engine.check_invariants()
    assert engine.pool.num_free + engine.prefix_cache.cached_pages() == engine.num_pages - 1
    for rid in aborted:
        assert engine.scheduler.requests.get(rid) is None


def test_a_request_stopped_in_flight_is_not_scheduled_past_max_tokens(engines):
    """max_tokens is known ahead: the scheduler plans no row for a request whose last token the
    step in flight is sampling, so a finished request never costs a wasted row."""
    llm, _ = engines
    engine = llm.engine
    engine.add_request("one", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    rows = []
    while engine.has_unfinished():
        engine.step()
        rows.append([s.request.request_id for x in engine._in_flight for s in x.plan.seqs])
    # prefill samples token 1; decodes sample 2 and 3; nothing is planned after that
    assert rows[:3] == [["one"], ["one"], ["one"]] and all(r == [] for r in rows[3:])
    assert engine.scheduler.requests == {}
    engine.check_invariants()


def test_preempted_request_keeps_the_token_of_the_step_in_flight(engines):
    """A request preempted while planning step N+1 still gets the token step N sampled for it."""
    llm, _ = engines
    engine = llm.engine
    engine.add_request("p", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill launched
    engine.step()  # first decode launched, the prefill's token read
    req = engine.scheduler.requests["p"]
    assert req.num_pending == 1 and req.status == RequestStatus.RUNNING
    engine.scheduler._preempt(req)  # what a full pool does while planning the next step
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    final = [o for o in outs if o.finished][0].outputs[0].token_ids
    ref = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert final == ref and req.num_preemptions == 1
    engine.check_invariants()


def test_delta_outputs_add_up_to_the_final_one(engines):
    """cumulative=False (what the servers' streams ask for): outputs before the final one carry
    only their deltas, and those add up to the final output, logprobs included."""
    llm, _ = engines
    engine = llm.engine
    tok = llm.get_tokenizer()
    for i, params in enumerate([SamplingParams(max_tokens=20, temperature=0.8, seed=5, logprobs=2, ignore_eos=True),
                                SamplingParams(max_tokens=30, temperature=0.0, stop=[" the "])]):
        engine.add_request(f"d{i}", tok(PROMPTS[i]).input_ids, params, cumulative=False)
        engine.add_request(f"c{i}", tok(PROMPTS[i]).input_ids, params)
    text, ids, lps, finals = {}, {}, {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            rid = out.request_id
            text[rid] = text.get(rid, "") + out.delta_text
            ids[rid] = ids.get(rid, []) + out.delta_token_ids
            lps[rid] = lps.get(rid, []) + (out.delta_logprobs or [])
            if out.finished:
                finals[rid] = out.outputs[0]
            elif rid.startswith("d"):
                c = out.outputs[0]
                assert c.text == "" and c.token_ids == [] and c.logprobs is None
    for i in range(2):
        d, c = finals[f"d{i}"], finals[f"c{i}"]
        assert (d.text, d.token_ids, d.finish_reason, d.logprobs) == (c.text, c.token_ids, c.finish_reason, c.logprobs)
        assert text[f"d{i}"] == d.text and ids[f"d{i}"] == d.token_ids
        assert lps[f"d{i}"] == (d.logprobs or [])
    engine.check_invariants()
