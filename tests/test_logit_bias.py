"""logit_bias (issue 19): a per-request {token id: bias} added to the logits on device before
penalties, temperature and truncation, as a sparse per-row array.

-100 bans a token the model would pick, +100 forces one; a biased row never changes its
neighbours' tokens; seeded sampling, n > 1, speculative decoding (draft rows carry the bias) and
the compile guard; validation offline and the OpenAI server's 400s. The model is a tiny random
Llama with the default tokenizer's full vocabulary (49,152 ids), so every id the tests name is real.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_engine_options
from server_utils import make_full_vocab_tiny, post

from jaxserve import LLM, SamplingParams
from jaxserve.engine.sampler import SamplingArrays, empty_sampling_arrays, sample
from jaxserve.sampling_params import MAX_LOGIT_BIAS

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
PROMPTS = ["Hello there", "The cat sat on the mat. The cat sat on the mat. The cat", "1, 2, 3, 1, 2, 3, 1,",
           "def add(a, b):\n    return a + b\n"]
FORCED = 1234  # any id of the vocabulary: +100 makes it the only likely token


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_full_vocab_tiny(tmp_path_factory.mktemp("tiny-bias")))


@pytest.fixture(scope="module")
def llm(tiny_path) -> LLM:
    return LLM(model=tiny_path, **small_engine_options())


def tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    """Token ids of every completion of every prompt."""
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def sampled(seed: int, max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, **kw)


# ---- the sampler alone ----------------------------------------------------------------------------

def test_sampler_bias_equals_biased_logits_row_by_row():
    """Sparse bias on device == the same bias added densely to the logits beforehand, for greedy,
    plain, top-k and top-p rows; rows without a bias are untouched."""
    rng = np.random.default_rng(0)
    rows, vocab = 6, 1024
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    a = empty_sampling_arrays(rows, 4)
    a["temperature"][:] = [0.0, 0.0, 1.0, 0.8, 1.0, 1.0]
    a["top_k"][3] = 20
    a["top_p"][4] = 0.7
    a["seeds"][:] = np.arange(rows) + 11
    dense = np.zeros_like(logits)
    for r in (0, 2, 3, 4):  # row 1 and 5: no bias
        ids = rng.choice(vocab, size=MAX_LOGIT_BIAS if r == 2 else 5, replace=False)
        vals = rng.uniform(-100, 100, size=len(ids)).astype(np.float32)
        if r == 0:
            ids[0], vals[0] = int(np.argmax(logits[0])), -100.0  # ban the greedy choice
        a["logit_bias_ids"][r, : len(ids)] = ids
        a["logit_bias_values"][r, : len(ids)] = vals
        dense[r, ids] = vals
    plain = {k: v.copy() for k, v in a.items()}
    plain["logit_bias_ids"][:] = -1
    to_dev = lambda d: SamplingArrays(**{k: jnp.asarray(v) for k, v in d.items()})  # noqa: E731
    got = np.asarray(sample(jnp.asarray(logits), to_dev(a)).token_ids)
    want = np.asarray(sample(jnp.asarray(logits + dense), to_dev(plain)).token_ids)
    assert got.tolist() == want.tolist()
    assert got[0] != np.argmax(logits[0])
    unbiased = np.asarray(sample(jnp.asarray(logits), to_dev(plain)).token_ids)
    assert got[1] == unbiased[1] and got[5] == unbiased[5]


# ---- the engine -----------------------------------------------------------------------------------

def test_minus_100_bans_and_plus_100_forces_greedy(llm):
    free = tokens(llm, PROMPTS, greedy())
    banned = [set(t[0]) for t in free]  # every token the model picked, banned
    got = tokens(llm, PROMPTS, [greedy(logit_bias={t: -100 for t in b}) for b in banned])
    for out, b, ref in zip(got, banned, free):
        assert out[0][0] != ref[0][0] and not set(out[0]) & b, (out, b)
    forced = tokens(llm, PROMPTS, greedy(logit_bias={FORCED: 100}))
    assert all(t[0] == [FORCED] * 8 for t in forced), forced
    # A small bias changes nothing decisive here, but the request still runs with it.
    assert tokens(llm, PROMPTS[:1], greedy(logit_bias={FORCED: 0.0})) == free[:1]


def test_sampled_requests_obey_the_bias(llm):
    free = tokens(llm, PROMPTS, [sampled(seed=i) for i in range(len(PROMPTS))])
    banned = [set(t[0]) for t in free]
    got = tokens(llm, PROMPTS, [sampled(seed=i, logit_bias={t: -100 for t in b}) for i, b in enumerate(banned)])
    assert all(not set(out[0]) & b for out, b in zip(got, banned)), got
    forced = tokens(llm, PROMPTS, [sampled(seed=i, top_p=0.9, logit_bias={FORCED: 100}) for i in range(len(PROMPTS))])
    assert all(t[0] == [FORCED] * 8 for t in forced), forced
    # The same seed and bias: the same tokens (the bias is part of the row, not of the batch).
    assert tokens(llm, PROMPTS, [sampled(seed=i, logit_bias={t: -100 for t in b})
                                 for i, b in enumerate(banned)]) == got


def test_rows_with_and_without_a_bias_do_not_affect_each_other(llm):
    params = [greedy(), greedy(logit_bias={FORCED: 100}), sampled(seed=3), sampled(seed=4, logit_bias={FORCED: 5.0}),
              greedy(logit_bias={17: -100, 42: 50}), sampled(seed=5, top_k=10),
              sampled(seed=6, logit_bias={FORCED: -100, 99: 10}, repetition_penalty=1.3), greedy()]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    together = tokens(llm, prompts, params)
    alone = [tokens(llm, [p], q)[0] for p, q in zip(prompts, params)]
    assert together == alone


def test_n_completions_all_carry_the_bias(llm):
    free = tokens(llm, PROMPTS[:2], sampled(seed=9, n=3))
    banned = set().union(*(set(c) for t in free for c in t))
    got = tokens(llm, PROMPTS[:2], sampled(seed=9, n=3, logit_bias={t: -100 for t in list(banned)[:MAX_LOGIT_BIAS]}))
    assert all(len(t) == 3 and not any(set(c) & banned for c in t) for t in got), got
    forced = tokens(llm, PROMPTS[:2], sampled(seed=9, n=3, logit_bias={FORCED: 100}))
    assert all(c == [FORCED] * 8 for t in forced for c in t), forced


def test_speculative_decoding_gives_the_tokens_of_plain_decoding(tiny_path):
    """Draft rows copy their sequence's bias (the scheduler's _fill_draft_rows): with it the
    verification draws what plain decoding draws; without it a forced run would break at once."""
    ref = LLM(model=tiny_path, **small_engine_options(async_scheduling=False))
    spec = LLM(model=tiny_path, **small_engine_options(speculative_config=SPEC))
    free = tokens(ref, PROMPTS, greedy(max_tokens=16))
    params = [greedy(max_tokens=16, logit_bias={FORCED: 100}),
              greedy(max_tokens=16, logit_bias={t: -100 for t in set(free[1][0])}),
              sampled(seed=1, max_tokens=16, logit_bias={FORCED: 100}),
              sampled(seed=2, max_tokens=16, n=2, logit_bias={FORCED: 8.0, 77: 8.0}),
              greedy(max_tokens=16)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    want = tokens(ref, prompts, params)
    got = tokens(spec, prompts, params)
    assert got == want
    assert want[0][0] == [FORCED] * 16
    stats = spec.engine.spec_decode_stats
    assert stats.num_accepted_tokens > 10, stats  # the forced runs are drafted and accepted
    spec.engine.check_invariants()


def test_no_compile_after_warmup(tiny_path):
    llm = LLM(model=tiny_path, **small_engine_options(compile_ahead=True, max_num_seqs=8, max_num_batched_tokens=32,
                                                      max_model_len=128))
    for batch in (1, 3, 8):
        params = [greedy(logit_bias={FORCED: 100}) if i % 2 else sampled(seed=i) for i in range(batch)]
        tokens(llm, [PROMPTS[i % len(PROMPTS)] for i in range(batch)], params)
        tokens(llm, PROMPTS[:batch], greedy())  # steps without any bias
    assert llm.engine.compiles_after_warmup == 0


# ---- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bias, match", [
    ([1, 2], "must be a dict"),
    ({"5": 1.0}, "keys must be token ids"),
    ({-1: 1.0}, "keys must be token ids"),
    ({True: 1.0}, "keys must be token ids"),
    ({5: 100.5}, r"values must be in \[-100, 100\]"),
    ({5: float("nan")}, r"values must be in \[-100, 100\]"),
    ({5: "1"}, "values must be numbers"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS} entries"),
])
def test_sampling_params_refuse_bad_biases(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


def test_sampling_params_normalize_the_bias():
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={3: -100, 4: 2}).logit_bias == {3: -100.0, 4: 2.0}


def test_ids_past_the_vocabulary_are_refused_at_admission(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {vocab}\)"):
        llm.generate(["hi"], greedy(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished()


# ---- the OpenAI server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bias_srv(tiny_path, tmp_path_factory):
    from pathlib import Path

    from server_utils import start_server

    server = start_server(Path(tiny_path), tmp_path_factory.mktemp("xla-bias"))
    yield server
    server["proc"].terminate()
    server["proc"].wait(timeout=60)


@pytest.fixture(scope="module")
def client(bias_srv):
    import openai

    return openai.OpenAI(base_url=bias_srv["base"] + "/v1", api_key="-", max_retries=0)


@pytest.mark.slow
def test_http_logit_bias_bans_and_forces(client, bias_srv):
    from test_server_robust import assert_idle_and_consistent

    kw = dict(model="tiny", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    free = client.completions.create(prompt="Hello there", **kw).choices[0]
    first = free.model_extra["token_ids"][0]
    banned = client.completions.create(prompt="Hello there", logit_bias={str(first): -100}, **kw).choices[0]
    assert banned.model_extra["token_ids"][0] != first
    forced = client.completions.create(prompt="Hello there", logit_bias={str(FORCED): 100}, **kw).choices[0]
    assert forced.model_extra["token_ids"] == [FORCED] * 6
    msgs = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(messages=msgs, logit_bias={str(FORCED): 100}, n=2, seed=3,
                                          **{**kw, "temperature": 1.0})
    assert [c.model_extra["token_ids"] for c in chat.choices] == [[FORCED] * 6] * 2
    stream = client.chat.completions.create(messages=msgs, logit_bias={str(FORCED): 100}, stream=True, **kw)
    ids = [t for c in stream if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert ids == [FORCED] * 6
    assert_idle_and_consistent(bias_srv, timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("bias", [
    {"abc": 1}, {"1.5": 1}, {"-3": 1}, {"": 1},  # keys that are not token ids
    {"49152": 1}, {"99999999999": 1},  # past the vocabulary (49,152 ids)
    {"5": 101}, {"5": -100.01}, {"5": "1"}, {"5": None}, {"5": True},  # values
    {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)},  # too many entries
    {"5": 1, "05": 2},  # one token twice
    [5], "5:1", 5,  # not an object
])
def test_http_bad_logit_bias_is_a_400_naming_it(bias_srv, bias):
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, err = post(bias_srv, path, {**base, "model": "tiny", "max_tokens": 2, "logit_bias": bias})
        assert status == 400, (path, bias, err)
        assert err["error"]["param"] == "logit_bias" and err["error"]["type"] == "invalid_request_error", err
        assert "logit_bias" in err["error"]["message"], err
