"""The on-device sampler against exact reference distributions computed in numpy.

Statistical checks use fixed seeds (so they are deterministic) and a chi-square test on bins of
expected count >= 5; a case passes when its p-value is above P_MIN. Each distribution test also
checks that the same draws reject a slightly wrong target, so the test can fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.engine import sampler
from jaxserve.engine.sampler import MAX_BANNED, SamplingArrays, empty_sampling_arrays, sample

P_MIN = 1e-3  # chi-square p-value a correct sampler must beat (the draws are fixed, so no flakes)
P_WRONG = 1e-6  # and a wrong target must fall below

_jit_sample = jax.jit(sample)


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Exact target distribution: temperature, then top-k, then top-p (smallest prefix whose
    mass reaches p, first token kept) and min-p (relative to the max) on the top-k-renormalized
    probabilities; order by scaled logit, ties by lower id."""
    scaled = logits.astype(np.float32) / np.float32(max(temperature, 1e-6))
    order = np.argsort(-scaled, kind="stable")
    vals = scaled[order].astype(np.float64)
    vocab = len(logits)
    k = top_k if 0 < top_k < vocab else vocab
    in_k = np.arange(vocab) < k
    p = np.where(in_k, np.exp(vals - vals[0]), 0.0)
    p /= p.sum()
    before = np.cumsum(p) - p
    keep = in_k & ((before < top_p) | (top_p >= 1.0)) & (p >= min_p * p[0])
    keep[0] = True
    q = np.where(keep, p, 0.0)
    out = np.zeros(vocab)
    out[order] = q / q.sum()
    return out


def make_arrays(rows: list[dict], history_len: int = 1) -> SamplingArrays:
    a = empty_sampling_arrays(len(rows), history_len)
    for i, r in enumerate(rows):
        for k, v in r.items():
            a[k][i] = v
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in a.items()})


def draw(logits: np.ndarray, cases: list[dict], rows_per_case: int, calls: int, fn=_jit_sample,
         grouped: bool = False) -> np.ndarray:
    """Sample `calls` times a batch with rows_per_case rows of each case, interleaved (or, if
    grouped, each case in its own contiguous rows), every row with its own seed and the call
    index as the step. Returns tokens [cases, calls * rows_per_case]."""
    pairs = [(j, i) for j in range(len(cases)) for i in range(rows_per_case)] if grouped else \
        [(j, i) for i in range(rows_per_case) for j in range(len(cases))]
    rows = [dict(cases[j], seeds=1000 * j + i) for j, i in pairs]
    batch_logits = jnp.asarray(np.tile(logits, (len(rows), 1)))
    out = []
    for step in range(calls):
        s = make_arrays([dict(r, steps=step) for r in rows])
        out.append(np.asarray(fn(batch_logits, s).token_ids))
    toks = np.stack(out)  # [calls, rows]
    case_of = np.array([j for j, _ in pairs])
    return np.stack([toks[:, case_of == j].reshape(-1) for j in range(len(cases))])


def chi2_pvalue(tokens: np.ndarray, probs: np.ndarray, bins: list[np.ndarray] | None = None) -> float:
    """Chi-square p-value of the draws against probs, over the given token bins (default: one
    per token), merging bins of expected count < 5 into one."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    if bins is None:
        bins = [np.asarray([t]) for t in range(len(probs))]
    exp = np.array([probs[b].sum() for b in bins]) * n
    obs = np.array([counts[b].sum() for b in bins])
    small = exp < 5
    exp = np.append(exp[~small], exp[small].sum())
    obs = np.append(obs[~small], obs[small].sum())
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0
        exp, obs = exp[:-1], obs[:-1]
    return float(stats.chisquare(obs, exp).pvalue)


def rank_bins(probs: np.ndarray, num: int) -> list[np.ndarray]:
    """Bins of roughly equal mass over the support, in decreasing-probability order."""
    support = np.nonzero(probs)[0]
    support = support[np.argsort(-probs[support], kind="stable")]
    edges = np.searchsorted(np.cumsum(probs[support]), np.linspace(0, 1, num + 1)[1:-1])
    return [b for b in np.split(support, edges) if len(b)]


def drop_boundary(probs: np.ndarray) -> np.ndarray:
    """A wrong target: the kept set without its least likely token."""
    q = probs.copy()
    support = np.nonzero(q)[0]
    q[support[np.argmin(q[support])]] = 0.0
    return q / q.sum()


def small_logits() -> np.ndarray:
    # 300 is not a multiple of the sampler's block (padding path); a tie group in the middle
    logits = 2.0 * np.random.default_rng(0).standard_normal(300).astype(np.float32)
    logits[[7, 40, 41, 90]] = np.float32(np.sort(logits)[-6])
    return logits


SMALL_CASES = {
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=0.8, top_k=10),
    "top_p": dict(temperature=0.8, top_p=0.9),  # rejection from the full distribution
    "small_top_p": dict(temperature=1.0, top_p=0.3),  # within lax.top_k's set
    "min_p": dict(temperature=1.0, min_p=0.1),
    "top_k_top_p_min_p": dict(temperature=1.2, top_k=20, top_p=0.8, min_p=0.02),
    "top_p_min_p": dict(temperature=0.9, top_p=0.7, min_p=0.05),
    "hot_top_k_top_p": dict(temperature=2.0, top_k=40, top_p=0.95),
}


def _margin_ok(logits: np.ndarray, c: dict) -> None:
    """The target must not sit within float rounding of an active top-p / min-p boundary."""
    args = (c.get("temperature", 1.0), c.get("top_k", 0), c.get("top_p", 1.0), c.get("min_p", 0.0))
    a = reference(logits, *args) > 0
    for dp in (-1e-5, 1e-5):  # f32 sums over 8K tokens are good to ~1e-6
        top_p = args[2] + dp if args[2] < 1.0 else 1.0
        min_p = args[3] + dp if args[3] > 0.0 else 0.0
        assert np.array_equal(a, reference(logits, args[0], args[1], top_p, min_p) > 0), c


def test_distribution_small_vocab_mixed_batch():
    logits = small_logits()
    cases = list(SMALL_CASES.values())
    toks = draw(logits, cases, rows_per_case=16, calls=250)  # 4,000 draws a case, all in one mixed batch
    for (name, c), t in zip(SMALL_CASES.items(), toks):
        _margin_ok(logits, c)
        ref = reference(logits, c.get("temperature", 1.0), c.get("top_k", 0), c.get("top_p", 1.0), c.get("min_p", 0.0))
        assert np.all(ref[t] > 0), f"{name}: sampled a token outside the kept set"
        p = chi2_pvalue(t, ref)
        assert p > P_MIN, f"{name}: p={p:.2e}"
        if np.count_nonzero(ref) > 1:
            wrong = chi2_pvalue(t, drop_boundary(ref)) if ref[ref > 0].min() > 0.01 else 0.0
            assert wrong < P_WRONG, f"{name}: the test cannot tell a wrong target (p={wrong:.2e})"


def large_logits() -> np.ndarray:
    # flat enough that nucleus and top-k sets hold thousands of tokens, far past lax.top_k's
    # smallest bucket: the rejection rounds and the exact full-sort fallback carry these cases
    return 0.7 * np.random.default_rng(1).standard_normal(8192).astype(np.float32)


LARGE_CASES = {
    "small_top_p_past_bound": dict(temperature=1.0, top_p=0.3),
    "top_p": dict(temperature=1.0, top_p=0.92),
    "top_k_3000_top_p": dict(temperature=1.0, top_k=3000, top_p=0.9),
    "top_k_6000_exact": dict(temperature=1.0, top_k=6000, top_p=0.8),  # past the largest top_k bucket
    "top_p_min_p": dict(temperature=1.0, top_p=0.6, min_p=0.2),
}


def _check_large(toks: np.ndarray, cases: dict) -> None:
    logits = large_logits()
    for (name, c), t in zip(cases.items(), toks):
        _margin_ok(logits, c)
        ref = reference(logits, c.get("temperature", 1.0), c.get("top_k", 0), c.get("top_p", 1.0), c.get("min_p", 0.0))
        assert np.count_nonzero(ref) > 256, name  # the kept set really is past the bounded set
        assert np.all(ref[t] > 0), f"{name}: sampled a token outside the kept set"
        bins = rank_bins(ref, 20)
        p = chi2_pvalue(t, ref, bins)
        assert p > P_MIN, f"{name}: p={p:.2e}"
        # a wrong target that keeps 10% fewer tokens must be told apart
        support = np.nonzero(ref)[0]
        wrong = ref.copy()
        wrong[support[np.argsort(ref[support])[: len(support) // 10]]] = 0
        assert chi2_pvalue(t, wrong / wrong.sum(), bins) < P_WRONG, name


@pytest.mark.timeout(900)
def test_distribution_large_vocab_past_bound():
    # grouped: a row block holding a large top-k row would give a small-top_p row a big enough
    # lax.top_k set, and hide a fault in the bounded path
    toks = draw(large_logits(), list(LARGE_CASES.values()), rows_per_case=16, calls=120, grouped=True)
    _check_large(toks, LARGE_CASES)


@pytest.mark.timeout(900)
def test_distribution_exact_fallback(monkeypatch):
    """With no rejection rounds left, every row not settled in the first round takes the full
    sort; its distribution must be the same."""
    monkeypatch.setattr(sampler, "_ROUNDS", 0)
    fn = jax.jit(lambda l, s: sampler.sample(l, s))  # a fresh trace that sees the patched constant
    cases = {k: LARGE_CASES[k] for k in ("small_top_p_past_bound", "top_p")}
    toks = draw(large_logits(), list(cases.values()), rows_per_case=16, calls=60, fn=fn, grouped=True)
    _check_large(toks, cases)


ALL_PATHS = [
    dict(temperature=0.0),
    dict(temperature=0.8),
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=1.0, top_p=0.3),
    dict(temperature=0.8, top_k=50),
    dict(temperature=0.8, min_p=0.05),
    dict(temperature=1.0, top_k=6000),
    dict(temperature=1.0, top_k=3000),  # a big lax.top_k set next to the small-top_p row
    dict(temperature=1.1, top_k=30, top_p=0.9, min_p=0.01),
]


def test_seed_independent_of_batch():
    """Same logits, options, seed and step give the same token in any batch, at any position."""
    rng = np.random.default_rng(2)
    vocab = 8192
    n = 16
    rows = [dict(ALL_PATHS[i % len(ALL_PATHS)], seeds=int(rng.integers(1 << 32)), steps=int(rng.integers(1000)))
            for i in range(n)]
    # flat rows keep the small-top_p nucleus past the smallest lax.top_k set
    scale = np.where([r.get("top_p", 1.0) < 0.5 for r in rows], 0.5, rng.choice([0.5, 2.0, 4.0], n))
    logits = (rng.standard_normal((n, vocab)) * scale[:, None]).astype(np.float32)
    base = np.asarray(_jit_sample(jnp.asarray(logits), make_arrays(rows)).token_ids)
    # a bigger batch: the same rows shuffled among strangers with other options
    big = 48
    pos = rng.permutation(big)[:n]
    big_logits = rng.standard_normal((big, vocab)).astype(np.float32)
    big_rows = [dict(ALL_PATHS[int(rng.integers(len(ALL_PATHS)))], seeds=int(rng.integers(1 << 32)), steps=3)
                for _ in range(big)]
    for i, p in enumerate(pos):
        big_logits[p] = logits[i]
        big_rows[p] = rows[i]
    again = np.asarray(_jit_sample(jnp.asarray(big_logits), make_arrays(big_rows)).token_ids)
    np.testing.assert_array_equal(again[pos], base)
    # one row alone (a request resumed after preemption, say)
    for i in range(n):
        alone = _jit_sample(jnp.asarray(logits[i: i + 1]), make_arrays([rows[i]])).token_ids
        assert int(alone[0]) == base[i], (i, rows[i])
    # and the step does change the draw
    moved = np.asarray(_jit_sample(jnp.asarray(logits), make_arrays([dict(r, steps=r["steps"] + 1) for r in rows])).token_ids)
    assert np.any(moved != base)


def test_greedy_rows_and_bans():
    rng = np.random.default_rng(3)
    vocab, n = 4096, 64
    logits = (3.0 * rng.standard_normal((n, vocab))).astype(np.float32)
    top = np.argsort(-logits, axis=1, kind="stable")
    rows = []
    for i in range(n):
        r = dict(ALL_PATHS[i % len(ALL_PATHS)], seeds=i)
        rows.append(r)
    hits = np.zeros(n, bool)
    for step in range(30):
        a = empty_sampling_arrays(n, 1)
        for i, r in enumerate(rows):
            for k, v in r.items():
                a[k][i] = v
            a["steps"][i] = step
            if i % 2:  # odd rows ban their 5 most likely tokens (as min_tokens does with EOS)
                a["banned"][i, :5] = top[i, :5]
        s = SamplingArrays(**{k: jnp.asarray(v) for k, v in a.items()})
        toks = np.asarray(_jit_sample(jnp.asarray(logits), s).token_ids)
        for i in range(n):
            if i % 2:
                assert toks[i] not in top[i, :5], (i, rows[i])
                hits[i] |= toks[i] == top[i, 5]
            if rows[i]["temperature"] == 0.0:
                assert toks[i] == top[i, 5 if i % 2 else 0]
    assert hits.any()  # bans move the mass to the next tokens, which do get sampled


def test_banned_padding_and_range():
    """-1 padding bans nothing (not the last id, as a negative index would)."""
    vocab = 512
    logits = np.zeros((2, vocab), np.float32)
    logits[:, vocab - 1] = 10.0
    a = empty_sampling_arrays(2, 1)
    a["banned"][1, :MAX_BANNED] = -1
    s = SamplingArrays(**{k: jnp.asarray(v) for k, v in a.items()})
    np.testing.assert_array_equal(np.asarray(_jit_sample(jnp.asarray(logits), s).token_ids), [vocab - 1] * 2)


def test_logprobs_of_raw_distribution():
    rng = np.random.default_rng(4)
    vocab = 1000
    logits = rng.standard_normal((8, vocab)).astype(np.float32)
    rows = [dict(ALL_PATHS[i], seeds=i, want_logprobs=True) for i in range(8)]
    out = _jit_sample(jnp.asarray(logits), make_arrays(rows))
    lp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    toks = np.asarray(out.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(lp)[np.arange(8), toks], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 0], np.argmax(logits, axis=1))


def test_penalties_still_apply():
    """Greedy with a repetition penalty picks the best token not yet seen when it is close."""
    vocab = 256
    logits = np.zeros((1, vocab), np.float32)
    logits[0, 5], logits[0, 6] = 2.0, 1.9
    a = empty_sampling_arrays(1, 4)
    a["repetition_penalty"][0] = 1.2
    a["history"][0, :2] = [5, 9]
    a["prompt_lens"][0] = 2
    s = SamplingArrays(**{k: jnp.asarray(v) for k, v in a.items()})
    assert int(_jit_sample(jnp.asarray(logits), s).token_ids[0]) == 6


@pytest.mark.parametrize("vocab", [1000, 4096])  # the whole-row form and the block form
def test_greedy_is_jnp_argmax(vocab):
    """Greedy rows take jnp.argmax's token: first of tied maxima, first NaN, all -inf -> 0."""
    x = np.random.default_rng(5).standard_normal((8, vocab)).astype(np.float32)
    x[1, [5, 700]] = 9.0
    x[2, [10, 3]] = np.nan
    x[3] = -np.inf
    x[4] = 1.0
    x[5, 999] = np.inf
    x[6, [300, 1, 299]] = 7.0  # tied maxima in different blocks
    s = make_arrays([{} for _ in range(8)])
    np.testing.assert_array_equal(np.asarray(_jit_sample(jnp.asarray(x), s).token_ids), np.argmax(x, axis=1))


def test_penalty_state_matches_the_stateless_history_sampler():
    """The device-resident penalty state gives, step after step, the tokens that the stateless
    sampler gives from each request's whole history: requests take slots, sample, leave, and a
    newcomer takes a freed slot (its stale counts must not leak); rows without penalties and
    padding rows share the batch. Greedy and sampled rows, all three penalties."""
    vocab, rows, slots, hist_len = 48, 4, 3, 64
    rng = np.random.default_rng(11)
    stateful = jax.jit(sampler.sample_with_state)
    state = sampler.empty_penalty_state(slots, vocab)
    params = [dict(repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.5, temperature=0.0),
              dict(repetition_penalty=1.3, temperature=0.8, seeds=7),
              dict(frequency_penalty=1.5, temperature=0.0),
              dict(temperature=0.0),  # no penalties: no slot
              dict(presence_penalty=1.2, temperature=1.0, seeds=3)]
    # (step it joins, step it leaves) per request; request 3 never holds a slot.
    life = [(0, 5), (0, 12), (1, 9), (0, 12), (5, 12)]  # 4 joins as 0 leaves: it takes slot 0's place
    prompts = [list(rng.integers(0, vocab, 6)) for _ in life]
    outputs: list[list[int]] = [[] for _ in life]
    slot_of: dict[int, int] = {}
    free = list(range(slots))[::-1]
    differs = 0
    for step in range(12):
        for r, (join, leave) in enumerate(life):
            if step == leave and r in slot_of:
                free.append(slot_of.pop(r))
        active = [r for r, (join, leave) in enumerate(life) if join <= step < leave]
        assert len(active) <= rows
        # Penalties matter only where logits are close: a small spread.
        logits = jnp.asarray(rng.standard_normal((rows, vocab)).astype(np.float32) * 0.5)
        ref, new = empty_sampling_arrays(rows, hist_len), empty_sampling_arrays(rows, hist_len)
        for i, r in enumerate(active):
            history = prompts[r] + outputs[r]
            for a in (ref, new):
                for k, v in params[r].items():
                    a[k][i] = v
                a["steps"][i] = len(outputs[r])
            ref["history"][i, : len(history)] = history
            ref["prompt_lens"][i] = len(prompts[r])
            if r == 3:
                continue
            if r not in slot_of:
                slot_of[r] = free.pop()
                new["penalty_init"][i] = True
                new["history"][i, : len(history)] = history
                new["prompt_lens"][i] = len(prompts[r])
            new["penalty_slot"][i] = slot_of[r]
        want = np.asarray(_jit_sample(logits, SamplingArrays(**{k: jnp.asarray(v) for k, v in ref.items()})).token_ids)
        out, state = stateful(logits, SamplingArrays(**{k: jnp.asarray(v) for k, v in new.items()}), None, state)
        got = np.asarray(out.token_ids)
        np.testing.assert_array_equal(got[: len(active)], want[: len(active)], err_msg=f"step {step}")
        for i, r in enumerate(active):
            outputs[r].append(int(got[i]))
        differs += int(np.sum(got[: len(active)] != np.asarray(jnp.argmax(logits, -1))[: len(active)]))
    assert differs >= 5, differs  # penalties changed tokens: the comparison above is not vacuous
    counts = np.asarray(state.counts)
    for r, slot in slot_of.items():  # the live slots hold exactly their requests' output counts
        np.testing.assert_array_equal(counts[slot], np.bincount(outputs[r], minlength=vocab))
