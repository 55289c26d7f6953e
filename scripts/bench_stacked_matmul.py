#!/usr/bin/env python
"""The CPU stacked-weight matmul kernel against XLA's dot inside a layer scan, in one run.

The default model's seven projections (SmolLM2-135M: hidden 576, MLP 1536, 3 KV heads of 64),
30 layers stacked [L, in, out] and run under lax.scan as the model runs them, at each row count:
XLA's dot on the scan's weight slices (which XLA copies out of the stack first) against
jaxserve/cpu_kernels/stacked_matmul.cc reading the stack in place. Median of --repeats calls;
the crossover row count is where the model's kernel limit (stacked.MAX_ROWS) comes from.

    python scripts/bench_stacked_matmul.py --out docs/results/bench_stacked_matmul_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxserve.cpu_kernels.stacked import stacked_matmul_cpu  # noqa: E402

SHAPES = {"wq": (576, 576), "wk": (576, 192), "wv": (576, 192), "wo": (576, 576),
          "w_gate": (576, 1536), "w_up": (576, 1536), "w_down": (1536, 576)}


def layer_stack(use_kernel: bool, num_layers: int):
    @jax.jit
    def run(x, weights):
        def layer(x, xs):
            p, l = xs

            def mm(h, name):
                return stacked_matmul_cpu(h, weights[name], l) if use_kernel else h @ p[name]

            q, k, v = mm(x, "wq"), mm(x, "wk"), mm(x, "wv")
            x = x + mm(q + 0.1 * jnp.tile(k, 3) + 0.1 * jnp.tile(v, 3), "wo")
            return x + mm(jax.nn.silu(mm(x, "w_gate")) * mm(x, "w_up"), "w_down"), None

        xs = ({} if use_kernel else weights, jnp.arange(num_layers, dtype=jnp.int32))
        return jax.lax.scan(layer, x, xs)[0]

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    weights = {n: jnp.asarray(rng.standard_normal((args.layers, *s), dtype=np.float32) * 0.01)
               for n, s in SHAPES.items()}
    results = []
    print(f"{'rows':>5s} {'XLA scan (ms)':>14s} {'kernel (ms)':>12s} {'speed-up':>9s} {'max rel diff':>13s}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 576), dtype=np.float32))
        times, outs = {}, {}
        for name, use_kernel in (("xla", False), ("kernel", True)):
            f = layer_stack(use_kernel, args.layers)
            outs[name] = np.asarray(f(x, weights))
            ts = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                f(x, weights).block_until_ready()
                ts.append(time.perf_counter() - t)
            times[name] = statistics.median(ts) * 1e3
        diff = float(np.abs(outs["xla"] - outs["kernel"]).max() / np.abs(outs["xla"]).max())
        results.append({"rows": rows, "xla_ms": times["xla"], "kernel_ms": times["kernel"], "max_rel_diff": diff})
        print(f"{rows:5d} {times['xla']:14.2f} {times['kernel']:12.2f} {times['xla'] / times['kernel']:8.2f}x "
              f"{diff:13.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
