"""Sampler cost on CPU: the previous full-sort sampler vs the current one, jitted, in one run.

    .venv/bin/python scripts/bench_sampler.py [--rows 32 128] [--vocab 49152] [--repeats 7]

Random normal logits (scale 3, so distributions are neither flat nor one-hot); prints the median
(and min) ms per call of `jax.jit(sample)` for each option set.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine import sampler
from jaxserve.engine.sampler import SampleOutput, SamplingArrays, empty_sampling_arrays
from jaxserve.sampling_params import MAX_LOGPROBS


# ---- OLD: the full-sort sampler as it was before issue 17, copied here for the comparison only ----
def _old_sample_stochastic(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    rows, vocab = logits.shape
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, vocab)[:, None]
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < s.top_p[:, None]) & (probs >= s.min_p[:, None] * probs[:, :1])
    sorted_logits = jnp.where(keep | (rank == 0), sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seeds, s.steps)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    choice = jnp.argmax(sorted_logits + gumbel, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def old_sample(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    rows, vocab = logits.shape
    raw_logits = logits
    any_penalty = jnp.any((s.repetition_penalty != 1.0) | (s.presence_penalty != 0) | (s.frequency_penalty != 0))
    logits = jax.lax.cond(any_penalty,
                          lambda l, s: sampler._apply_penalties(l, s, *sampler._history_state(s, s.history, vocab)),
                          lambda l, _: l, logits, s)
    banned_valid = s.banned >= 0
    row_idx = jnp.broadcast_to(jnp.arange(rows)[:, None], s.banned.shape)
    ban = jnp.zeros((rows, vocab), jnp.bool_).at[row_idx, jnp.where(banned_valid, s.banned, 0)].max(banned_valid)
    logits = jnp.where(ban, -jnp.inf, logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    all_greedy = jnp.all(s.temperature == 0.0)
    sampled = jax.lax.cond(all_greedy, lambda l, _: greedy, _old_sample_stochastic, logits, s)
    tokens = jnp.where(s.temperature == 0.0, greedy, sampled)

    def logprobs(l, toks):
        lp = jax.nn.log_softmax(l, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, toks[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def no_logprobs(l, toks):
        return (jnp.zeros(rows, jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))

    token_lp, top_ids, top_lp = jax.lax.cond(jnp.any(s.want_logprobs), logprobs, no_logprobs, raw_logits, tokens)
    return SampleOutput(tokens, token_lp, top_ids, top_lp)
# ---- end of OLD ----


CASES = {
    "greedy": dict(temperature=0.0),
    "temp 0.8": dict(temperature=0.8),
    "temp 0.8 top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "temp 0.8 top_k 50": dict(temperature=0.8, top_k=50),
    "temp 0.8 min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "mixed (1/4 each)": None,  # greedy, temp, top_p, top_k rows interleaved
}


def arrays(rows: int, case: dict | None) -> SamplingArrays:
    a = empty_sampling_arrays(rows, 1)
    a["seeds"][:] = np.arange(rows)
    a["steps"][:] = 3
    if case is None:
        kinds = list(CASES.values())[:4]
        for i in range(rows):
            for k, v in kinds[i % 4].items():
                a[k][i] = v
    else:
        for k, v in case.items():
            a[k][:] = v
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in a.items()})


def timeit(fn, *args, repeats: int) -> tuple[float, float]:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times)), 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-old", action="store_true", help="the old sampler takes seconds per call")
    args = ap.parse_args()
    old, new = jax.jit(old_sample), jax.jit(sampler.sample)
    print(f"vocab {args.vocab}, jax {jax.__version__}, {jax.devices()[0].platform}; ms per call, median (min) "
          f"of {args.repeats}")
    print(f"{'rows':>4}  {'case':<22} {'old':>18} {'new':>16} {'new / new greedy':>17}")
    for rows in args.rows:
        logits = jnp.asarray(3.0 * np.random.default_rng(rows).standard_normal((rows, args.vocab)), jnp.float32)
        greedy_new = None
        for name, case in CASES.items():
            s = arrays(rows, case)
            o = (float("nan"),) * 2 if args.skip_old else timeit(old, logits, s, repeats=args.repeats)
            n = timeit(new, logits, s, repeats=args.repeats)
            greedy_new = n[0] if greedy_new is None else greedy_new
            print(f"{rows:>4}  {name:<22} {o[0]:>9.1f} ({o[1]:>6.1f}) {n[0]:>7.1f} ({n[1]:>6.1f}) "
                  f"{n[0] / greedy_new:>16.2f}x", flush=True)


if __name__ == "__main__":
    main()
