"""KV memory: paged allocation against worst-case contiguous reservation, on a realistic length mix.

    python scripts/bench_memory.py --budget-gib 1.0 --page-size 16

Draws requests (prompt 20-500, answer 10-500 tokens, max model length 2048, SmolLM2-135M's KV
shape in float32), then counts how many fit concurrently in one KV budget when each reserves
max_model_len contiguous slots, and when each holds only the pages its tokens need (PagePool, the
allocator the engine uses). Waste = reserved slots not holding a token.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxserve.cache.page_pool import OutOfPagesError, PagePool  # noqa: E402

KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x kv heads x head_dim x f32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--page-size", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    slots = int(args.budget_gib * 2**30 // KV_BYTES_PER_TOKEN)
    lengths = rng.integers(20, 501, 100_000) + rng.integers(10, 501, 100_000)  # prompt + answer
    contiguous = slots // args.max_model_len
    used = lengths[:contiguous].sum()
    print(f"KV budget {args.budget_gib} GiB = {slots} token slots; mean sequence {lengths.mean():.0f} tokens")
    print(f"{'scheme':28s} {'sequences':>9s} {'waste':>7s}")
    print(f"{'contiguous max_model_len':28s} {contiguous:9d} {1 - used / (contiguous * args.max_model_len):7.1%}")
    for ps in args.page_size:
        pool = PagePool(slots // ps + 1, ps)
        n = 0
        try:
            while True:  # admit sequences until the pool is full
                pool.ensure_capacity(f"s{n}", int(lengths[n]))
                n += 1
        except OutOfPagesError:
            pass
        pool.check_invariants()
        held = (pool.num_pages - 1 - pool.num_free) * ps
        print(f"{'paged, page_size ' + str(ps):28s} {n:9d} {1 - lengths[:n].sum() / held:7.1%}")


if __name__ == "__main__":
    main()
