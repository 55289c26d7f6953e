"""One MoE layer three ways: grouped by expert ("tiled" loop, lax.ragged_dot) vs a dense all-experts pass.

    JAX_PLATFORMS=cpu python scripts/bench_moe.py [--tokens 16 256] [--out docs/results/bench_moe.json]
    JAX_PLATFORMS=cpu python scripts/bench_moe.py --memory [--out docs/results/moe_memory.json]

FLOPs: the analytical count of each method's matmuls (routed = T*k rows per expert FFN, dense =
T*X rows), next to what XLA's cost analysis of the compiled step says (it counts a while loop's
body once, so the tiled figure is per tile). Time: median of --iters runs after a warm-up.

--ep: on 4 simulated CPU devices, expert weights split over the `model` axis: our shard_map (each
device its own experts on the replicated tokens, one psum) against leaving the split weights to
XLA's sharding propagation (no shard_map: XLA gathers what the grouped matmul needs). Collective
bytes from the compiled HLO's all-gather / all-reduce / all-to-all shapes.

--memory: weights and KV per device for Qwen3-30B-A3B's shapes (bfloat16) on meshes 1x1, 1x4, 1x8,
from the model's abstract parameters (nnx.eval_shape) and the partition rules' shard shapes on an
abstract mesh (no device holds anything), and the largest batch of 2,048-token sequences
(1k in / 1k out) whose KV fits next to the weights on a 16 GB and a 141 GB device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--ep" in sys.argv:  # simulated devices must be asked for before jax loads
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import moe
from jaxserve.models.llama import ModelConfig, param_shapes


def layer(E: int, X: int, F: int, k: int, seed: int = 0) -> tuple[ModelConfig, dict[str, jax.Array]]:
    cfg = ModelConfig(architecture="bench", vocab_size=8, hidden_size=E, intermediate_size=F, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=8, num_experts=X, num_experts_per_tok=k,
                      moe_intermediate_size=F, norm_topk_prob=True)
    rng = np.random.default_rng(seed)
    p = dict(router=rng.normal(0, 0.05, (E, X)), we_gate=rng.normal(0, 0.05, (X, E, F)),
             we_up=rng.normal(0, 0.05, (X, E, F)), we_down=rng.normal(0, 0.05, (X, F, E)))
    return cfg, {n: jnp.asarray(v, jnp.float32) for n, v in p.items()}


def time_fn(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# Qwen/Qwen3-30B-A3B config.json
QWEN3_30B_A3B = dict(architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)


def memory_table(meshes: list[str], seq_len: int = 2048, capacities_gb: tuple[float, ...] = (16, 141)) -> list[dict]:
    from flax import nnx
    from jax.sharding import AbstractMesh, NamedSharding

    from jaxserve import parallel
    from jaxserve.models.llama import LlamaForCausalLM

    cfg = ModelConfig(**QWEN3_30B_A3B)
    rows: list[dict] = []
    for mesh in meshes:
        data, tp = parallel.parse_mesh(mesh)
        parallel.check_splittable(cfg, tp)
        layout = parallel.head_layout(cfg, tp)
        served = ModelConfig(**{**QWEN3_30B_A3B, "num_heads": len(layout.q_heads),
                                "num_kv_heads": len(layout.kv_heads)})
        model = nnx.eval_shape(lambda: LlamaForCausalLM(served, jnp.bfloat16))
        amesh = AbstractMesh((1, tp), parallel.MESH_AXES)
        weights = experts = 0
        for name in param_shapes(served):
            a = getattr(model, name).get_value()  # a ShapeDtypeStruct: nothing allocated
            shard = NamedSharding(amesh, parallel.PARAM_SPECS[name]).shard_shape(a.shape)
            nbytes = int(np.prod(shard)) * a.dtype.itemsize
            weights += nbytes
            experts += nbytes if name.startswith("we_") else 0
        kv_token = served.kv_bytes_per_token // 4 * 2 // tp  # bfloat16, KV heads split over tp
        row = dict(mesh=mesh, served_heads=[served.num_heads, served.num_kv_heads], weights_per_device=weights,
                   expert_weights_per_device=experts, kv_bytes_per_token_per_device=kv_token)
        for gb in capacities_gb:
            free = gb * 1e9 - weights
            row[f"max_batch_{gb:g}GB"] = max(0, int(free // (kv_token * seq_len)))
        rows.append(row)
    return rows


def collective_bytes(hlo: str) -> dict[str, int]:
    """Result bytes of each collective kind in compiled HLO text (f32/s32/bf16 shapes)."""
    import re

    sizes = {"f32": 4, "s32": 4, "bf16": 2, "u32": 4, "pred": 1}
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        kinds = "all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute"
        m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* (" + kinds + r")\(", line)
        if m and m.group(1) in sizes:
            n = int(np.prod([int(d) for d in m.group(2).split(",") if d])) if m.group(2) else 1
            out[m.group(3)] = out.get(m.group(3), 0) + n * sizes[m.group(1)]
    return out


def ep_bench(a: argparse.Namespace) -> list[dict]:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    cfg, p = layer(a.hidden, a.experts, a.ffn, a.topk)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "model"))
    split = NamedSharding(mesh, P("model", None, None))
    p = {n: jax.device_put(v, split if n.startswith("we_") else NamedSharding(mesh, P())) for n, v in p.items()}
    rows = []
    for T in a.tokens:
        h = jax.device_put(jnp.asarray(np.random.default_rng(T).normal(0, 1, (T, a.hidden)), jnp.float32),
                           NamedSharding(mesh, P()))
        ref = None
        for name, m in (("shard_map_psum", mesh), ("xla_propagation", None)):
            fn = jax.jit(lambda h, p, m=m: moe.moe_mlp(h, p, cfg, impl="tiled", mesh=m))
            hlo = fn.lower(h, p).compile().as_text()
            seconds = time_fn(fn, h, p, iters=a.iters)
            out = np.asarray(fn(h, p))
            ref = out if ref is None else ref
            row = dict(strategy=name, tokens=T, seconds=seconds, collective_bytes=collective_bytes(hlo),
                       max_abs_diff_vs_first=float(np.abs(out - ref).max()))
            rows.append(row)
            print(f"T={T:5d} {name:16s} {seconds * 1e3:9.2f} ms  collectives {row['collective_bytes']}  "
                  f"|diff| {row['max_abs_diff_vs_first']:.1e}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--impls", nargs="+", default=["tiled", "ragged_dot", "dense"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--ep", action="store_true")
    a = ap.parse_args()
    if a.ep:
        rows = ep_bench(a)
        if a.out:
            a.out.write_text(json.dumps(dict(hidden=a.hidden, experts=a.experts, ffn=a.ffn, topk=a.topk, devices=4,
                                             rows=rows), indent=1))
        return
    if a.memory:
        rows = memory_table(["1x1", "1x4", "1x8"])
        gib = 2**30
        for r in rows:
            print(f"{r['mesh']:>4} heads {r['served_heads']} weights/device {r['weights_per_device'] / gib:7.2f} GiB "
                  f"(experts {r['expert_weights_per_device'] / gib:6.2f}) KV/token/device "
                  f"{r['kv_bytes_per_token_per_device']} B  max batch 16 GB {r['max_batch_16GB']}  "
                  f"141 GB {r['max_batch_141GB']}")
        if a.out:
            a.out.write_text(json.dumps(rows, indent=1))
        return
    cfg, p = layer(a.hidden, a.experts, a.ffn, a.topk)
    E, X, F, k = a.hidden, a.experts, a.ffn, a.topk
    rows = []
    for T in a.tokens:
        h = jnp.asarray(np.random.default_rng(T).normal(0, 1, (T, E)), jnp.float32)
        ref = None
        for impl in a.impls:
            fn = jax.jit(lambda h, p, impl=impl: moe.moe_mlp(h, p, cfg, impl=impl))
            compiled = fn.lower(h, p).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            seconds = time_fn(fn, h, p, iters=a.iters)
            out = np.asarray(fn(h, p))
            ref = out if ref is None else ref
            ffn_rows = T * X if impl == "dense" else T * k
            if impl == "tiled":  # the rows the loop really multiplies: whole tiles
                _, ids = moe.route(h @ p["router"], k, cfg.router, cfg.norm_topk_prob)
                sizes = np.bincount(np.asarray(ids).ravel(), minlength=X)
                B = moe.tile_rows(T * k, X)
                ffn_rows = int(np.sum(-(-sizes // B)) * B)
            if impl == "ragged_dot" and jax.default_backend() == "cpu":
                ffn_rows = T * k * X  # the default lowering: every row masked against every expert
            flops = 2 * 3 * ffn_rows * E * F + 2 * T * E * X  # three FFN matmuls + the router
            row = dict(impl=impl, tokens=T, ffn_rows=ffn_rows, routed_rows=T * k, seconds=seconds, flops=flops,
                       gflops_per_s=flops / seconds / 1e9,
                       xla_cost_flops=float(cost.get("flops", float("nan"))),
                       max_abs_diff_vs_first=float(np.abs(out - ref).max()))
            rows.append(row)
            print(f"T={T:5d} {impl:10s} {seconds * 1e3:9.2f} ms  {flops / 1e9:8.3f} GFLOP (analytical)  "
                  f"XLA cost {row['xla_cost_flops'] / 1e9:8.3f} GFLOP  |diff| {row['max_abs_diff_vs_first']:.1e}")
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0]), jax=jax.__version__,
                  hidden=E, experts=X, ffn=F, topk=k,
                  tile_rows={T: moe.tile_rows(T * k, X) for T in a.tokens}, rows=rows)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
