"""One layer's ragged paged attention on this CPU: the C++ kernel against the XLA serving path.

    python scripts/bench_attention.py

SmolLM2-135M's heads (9 query, 3 KV, head size 64), float32, pages of 16 scattered over the pool.
Decode batches of 32 and 64 sequences (contexts drawn from 40-350 tokens) and a 512-token prefill
step (two fresh 128-token prompts and a 256-token chunk after 200 tokens of context). Prints the
median time of each backend, their ratio and the largest difference between their outputs.

Then the C++ kernel alone on one decode step (--pool-seqs sequences of --pool-context tokens) with
the pool in float32, int8 and float8_e4m3fn (issue 18's 8-bit KV cache; scales are applied by the
caller, so the kernel reads the bytes as they are): time per pool dtype and the ratio to float32.
`--section pools` runs only that table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.attention import ragged_paged_attention_split, write_kv  # noqa: E402
from jaxserve.cpu_kernels import ragged_paged_attention_cpu  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def make_step(specs: list[tuple[int, int]], seed: int, num_pages: int = 4096) -> tuple:
    """specs: (new tokens, KV length) per sequence -> attention arguments and the new K/V."""
    rng = np.random.default_rng(seed)
    num_pages = max(num_pages, 1 + sum(-(-kv // PAGE) for _, kv in specs))
    width = max(-(-kv // PAGE) for _, kv in specs)
    tables = np.zeros((len(specs), width), np.int32)
    free = rng.permutation(np.arange(1, num_pages))
    used = 0
    slots, cu = [], [0]
    for i, (q_len, kv_len) in enumerate(specs):
        n = -(-kv_len // PAGE)
        tables[i, :n] = free[used: used + n]
        used += n
        pos = np.arange(kv_len - q_len, kv_len)
        slots += list(tables[i, pos // PAGE] * PAGE + pos % PAGE)
        cu.append(cu[-1] + q_len)
    T = cu[-1]
    pool = jnp.asarray(rng.standard_normal((num_pages, PAGE, 2 * KV_HEADS, HEAD_DIM), np.float32))
    k_new = jnp.asarray(rng.standard_normal((T, KV_HEADS, HEAD_DIM), np.float32))
    v_new = jnp.asarray(rng.standard_normal((T, KV_HEADS, HEAD_DIM), np.float32))
    pool = write_kv(pool, k_new, v_new, jnp.asarray(slots, jnp.int32))
    q = jnp.asarray(rng.standard_normal((T, HEADS, HEAD_DIM), np.float32))
    args = (q, pool, jnp.asarray([kv for _, kv in specs], jnp.int32), jnp.asarray(tables),
            jnp.asarray(cu, jnp.int32), jnp.asarray([len(specs)], jnp.int32))
    return args, k_new, v_new


def median_ms(fn, args, repeats: int) -> tuple[float, jax.Array]:
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), out


def to_8bit(pool: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The pool as an 8-bit cache would hold it (one static scale, here chosen to use the range)."""
    if dtype == jnp.int8:
        return jnp.clip(jnp.round(pool * 32.0), -127, 127).astype(jnp.int8)
    return (pool * 64.0).astype(dtype)  # |x| * 64 stays far below e4m3fn's 448 for most entries


def bench_pools(num_seqs: int, context: int, repeats: int) -> None:
    """The kernel on one decode step, pool in float32 vs 8-bit (same q, same pages)."""
    step, _, _ = make_step([(1, context)] * num_seqs, seed=7)
    q, pool, *rest = step
    scale = HEAD_DIM ** -0.5
    cpu = jax.jit(lambda *a: ragged_paged_attention_cpu(*a, sm_scale=scale))
    print(f"\ndecode, {num_seqs} sequences x {context} context, C++ kernel, pool of "
          f"{pool.shape[0]} pages x {PAGE} tokens")
    print(f"{'pool dtype':16s} {'pool MB':>8s} {'ms':>8s} {'vs float32':>11s}")
    base = None
    for dtype in (jnp.float32, jnp.int8, jnp.float8_e4m3fn):
        p = pool if dtype == jnp.float32 else to_8bit(pool, dtype)
        t, _ = median_ms(cpu, (q, p, *rest), repeats)
        base = base or t
        print(f"{jnp.dtype(dtype).name:16s} {p.nbytes / 1e6:8.1f} {t:8.2f} {t / base:10.2f}x")


def bench_backends(repeats: int) -> None:
    """The XLA serving path against the C++ kernel, float32, on mixed steps."""
    rng = np.random.default_rng(0)
    cases = {
        "decode, 32 sequences": [(1, int(n)) for n in rng.integers(40, 350, 32)],
        "decode, 64 sequences": [(1, int(n)) for n in rng.integers(40, 350, 64)],
        "prefill, 512 tokens": [(128, 128), (128, 128), (256, 456)],
    }
    scale = HEAD_DIM ** -0.5
    print(f"{'step':24s} {'XLA path ms':>12s} {'C++ kernel ms':>14s} {'speed-up':>9s} {'max |diff|':>11s}")
    for i, (name, specs) in enumerate(cases.items()):
        step, k_new, v_new = make_step(specs, seed=i)
        xla = jax.jit(lambda *a: ragged_paged_attention_split(*a, k_new=k_new, v_new=v_new, sm_scale=scale))
        cpu = jax.jit(lambda *a: ragged_paged_attention_cpu(*a, sm_scale=scale))
        t_xla, out_xla = median_ms(xla, step, repeats)
        t_cpu, out_cpu = median_ms(cpu, step, repeats)
        diff = float(jnp.abs(out_xla - out_cpu).max())
        print(f"{name:24s} {t_xla:12.2f} {t_cpu:14.2f} {t_xla / t_cpu:8.2f}x {diff:11.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--section", choices=("all", "backends", "pools"), default="all")
    ap.add_argument("--pool-seqs", type=int, default=64)
    ap.add_argument("--pool-context", type=int, default=1000)
    args = ap.parse_args()
    if args.section in ("all", "backends"):
        bench_backends(args.repeats)
    if args.section in ("all", "pools"):
        bench_pools(args.pool_seqs, args.pool_context, args.repeats)


if __name__ == "__main__":
    main()
