#!/usr/bin/env python
"""Device check of the Pallas ragged paged attention kernels (for a GPU/TPU machine, not CI).

1. Correctness on the device: the platform's kernel vs the XLA reference on mixed decode/prefill
   batches (f32 and bf16, GQA, sliding window, soft cap).
2. Decode benchmark: batch 8/32/128 x context 512/2048/8192 (Llama-3-8B-like attention: 32 q heads,
   8 KV heads, head_dim 128, bf16, page 16). Reports kernel and reference time and the kernel's
   achieved memory bandwidth (KV bytes it must read + q/out) vs the device's peak.

3. Multi-device (when more than one device is visible, or with --meshes): the default model on
   meshes 1x1, 1xN and Nx1, greedy outputs compared with 1x1, output tokens/s of one batch of
   requests on each, per-device weight bytes.

Unattended, budgeted to finish in under 5 minutes (configs past the budget are skipped and
marked so). ``--quick``: fewer configs and iterations. ``--interpret``: tiny shapes through the
kernels' interpret modes, a smoke run for CPU.

    python scripts/device_check.py --out device_check.json [--quick] [--interpret]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.attention import ragged_paged_attention_xla  # noqa: E402
from jaxserve.pallas_kernels import ragged_paged_attention_gpu, ragged_paged_attention_tpu  # noqa: E402

# Peak HBM bandwidth (bytes/s) by device_kind substring; first match wins.
PEAK_BW = [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L4", 0.3e12),
           ("TPU v5 lite", 819e9), ("TPU v5e", 819e9), ("TPU v5p", 2765e9), ("TPU v5", 2765e9),
           ("TPU v6", 1640e9), ("TPU v4", 1228e9)]
BUDGET_S = 270.0


def peak_bandwidth(kind: str) -> float | None:
    return next((bw for k, bw in PEAK_BW if k.lower() in kind.lower()), None)


def kernels_for(platform: str, interpret: bool) -> dict[str, Callable[..., jax.Array]]:
    if interpret:
        return {
            "gpu_interpret": lambda *a, **k: ragged_paged_attention_gpu(*a, **k, interpret=True, block_q=16,
                                                                       block_kv=16, split_tokens=32),
            "tpu_interpret": lambda *a, **k: ragged_paged_attention_tpu(*a, **k, interpret=True, block_q=8,
                                                                       pages_per_block=2),
        }
    if platform == "tpu":
        # Both ways of splitting K/V out of a DMA'd head block: "strided" is the default, and
        # "indexed" (the one the CPU interpreter tests) is the fallback if Mosaic rejects it.
        return {"tpu": ragged_paged_attention_tpu,
                "tpu_indexed": lambda *a, **k: ragged_paged_attention_tpu(*a, **k, kv_split="indexed")}
    if platform == "gpu":
        return {"gpu": ragged_paged_attention_gpu}
    raise SystemExit(f"no Pallas kernel for platform {platform!r}; use --interpret on CPU")


def make_batch(rng: np.random.Generator, q_lens: list[int], kv_lens: list[int], *, page_size: int, kv_heads: int,
               group: int, head_dim: int, dtype: Any, pad_seqs: int = 1) -> tuple[tuple[jax.Array, ...], int]:
    """Random pool with each sequence's pages shuffled (never page 0); returns args and real rows."""
    n = len(q_lens)
    pages = [-(-L // page_size) for L in kv_lens]
    width = max(pages)
    num_pages = sum(pages) + 1
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    pt = np.zeros((n + pad_seqs, width), np.int32)
    k = 0
    for s, p in enumerate(pages):
        pt[s, :p] = perm[k:k + p]
        k += p
    kvl = np.zeros(n + pad_seqs, np.int32)
    kvl[:n] = kv_lens
    cu = np.zeros(n + pad_seqs + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    t = int(cu[n]) + 3
    key_q, key_kv = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    q = jax.random.normal(key_q, (t, kv_heads * group, head_dim), jnp.float32).astype(dtype)
    pool = jax.random.normal(key_kv, (num_pages, page_size, 2 * kv_heads, head_dim), jnp.float32).astype(dtype)
    args = (q, pool, jnp.asarray(kvl), jnp.asarray(pt), jnp.asarray(cu), jnp.asarray([n], jnp.int32))
    return args, int(cu[n])


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def time_fn(fn: Callable[[], jax.Array], iters: int) -> float:
    """Median seconds per call (after a compile/warm-up call)."""
    jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def check_correctness(kernels: dict[str, Callable[..., jax.Array]], interpret: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    scale = 1 if interpret else 4
    cases = [
        dict(name="mixed_f32_g4", q_lens=[1, 1, 7 * scale, 1], kv_lens=[1, 17, 40 * scale, 33 * scale], page_size=16,
             kv_heads=2, group=4, head_dim=128, dtype=jnp.float32, kw={}, tol=1e-5),
        dict(name="mqa_f32_d64_swa_cap", q_lens=[1, 5 * scale, 1], kv_lens=[9, 30 * scale, 65], page_size=8,
             kv_heads=1, group=8, head_dim=64, dtype=jnp.float32, kw=dict(sliding_window=16, soft_cap=30.0), tol=1e-5),
        dict(name="mixed_bf16_g8", q_lens=[1, 9 * scale, 1, 1], kv_lens=[100, 50 * scale, 16, 17], page_size=16,
             kv_heads=2, group=8, head_dim=128, dtype=jnp.bfloat16, kw={}, tol=3e-2),
    ]
    results = []
    for c in cases:
        args, rows = make_batch(rng, c["q_lens"], c["kv_lens"], page_size=c["page_size"], kv_heads=c["kv_heads"],
                                group=c["group"], head_dim=c["head_dim"], dtype=c["dtype"])
        kw = dict(sm_scale=c["head_dim"] ** -0.5, **c["kw"])
        with jax.default_matmul_precision("highest"):  # the oracle must not use TF32/bf16 passes
            ref = jax.jit(lambda *a: ragged_paged_attention_xla(*a, **kw))(*args)
        for name, fn in kernels.items():
            try:
                out = jax.jit(lambda *a: fn(*a, **kw))(*args)
            except Exception as e:  # noqa: BLE001 - report and go on: the run is unattended
                results.append(dict(case=c["name"], kernel=name, error=f"{type(e).__name__}: {e}"[:2000], ok=False))
                print(f"  {c['name']:<22} {name:<14} FAILED: {type(e).__name__}: {str(e)[:300]}")
                continue
            err = rel_err(out, ref)
            pad_ok = not np.asarray(out[rows:], np.float32).any()
            results.append(dict(case=c["name"], kernel=name, rel_err=err, tol=c["tol"], padding_zero=pad_ok,
                                ok=bool(err <= c["tol"] and pad_ok)))
            print(f"  {c['name']:<22} {name:<14} rel_err={err:.2e} (tol {c['tol']:.0e}) padding_zero={pad_ok}")
    return results


def bench_decode(kernels: dict[str, Callable[..., jax.Array]], kind: str, quick: bool, interpret: bool,
                 start: float) -> list[dict[str, Any]]:
    if interpret:
        batches, contexts, iters = [2, 4], [32, 64], 1
        shape = dict(page_size=16, kv_heads=2, group=2, head_dim=64, dtype=jnp.bfloat16)
    else:
        batches, contexts = ([8, 128], [512, 8192]) if quick else ([8, 32, 128], [512, 2048, 8192])
        iters = 5 if quick else 20
        shape = dict(page_size=16, kv_heads=8, group=4, head_dim=128, dtype=jnp.bfloat16)
    peak = peak_bandwidth(kind)
    itemsize = jnp.dtype(shape["dtype"]).itemsize
    rng = np.random.default_rng(1)
    rows = []
    for b in batches:
        for ctx in contexts:
            if time.time() - start > BUDGET_S:
                rows.append(dict(batch=b, context=ctx, skipped="time budget"))
                print(f"  batch {b} ctx {ctx}: skipped (time budget)")
                continue
            args, _ = make_batch(rng, [1] * b, [ctx] * b, **shape, pad_seqs=0)
            heads = shape["kv_heads"] * shape["group"]
            kw = dict(sm_scale=shape["head_dim"] ** -0.5)
            # Minimum traffic: every sequence's K and V once, plus q in and out.
            nbytes = (b * ctx * 2 * shape["kv_heads"] * shape["head_dim"] + 2 * b * heads * shape["head_dim"]) * itemsize
            row: dict[str, Any] = dict(batch=b, context=ctx, bytes=nbytes)
            ref_fn = jax.jit(lambda *a: ragged_paged_attention_xla(*a, **kw))
            row["xla_ms"] = time_fn(lambda: ref_fn(*args), iters) * 1e3
            ref = ref_fn(*args)
            for name, fn in kernels.items():
                f = jax.jit(lambda *a, fn=fn: fn(*a, **kw))
                try:
                    t = time_fn(lambda: f(*args), iters)
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
                    row[f"{name}_ms"] = row[f"{name}_GBps"] = row[f"{name}_pct_peak"] = None
                    print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_GBps"] = nbytes / t / 1e9
                row[f"{name}_pct_peak"] = None if peak is None else 100 * nbytes / t / peak
                row[f"{name}_rel_err"] = rel_err(f(*args), ref)
            rows.append(row)
            print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return rows


def print_table(rows: list[dict[str, Any]], kernels: list[str]) -> None:
    head = f"{'batch':>5} {'ctx':>6} {'xla ms':>9}" + "".join(
        f" {k + ' ms':>16} {'GB/s':>8} {'%peak':>6}" for k in kernels)
    print(head)
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>5} {r['context']:>6}  skipped ({r['skipped']})")
            continue
        line = f"{r['batch']:>5} {r['context']:>6} {r['xla_ms']:>9.3f}"
        for k in kernels:
            if r.get(f"{k}_ms") is None:
                line += f" {'failed':>16} {'':>8} {'':>6}"
                continue
            pct = r[f"{k}_pct_peak"]
            line += f" {r[f'{k}_ms']:>16.3f} {r[f'{k}_GBps']:>8.1f} {'n/a' if pct is None else f'{pct:.1f}':>6}"
        print(line)


def check_meshes(meshes: list[str], quick: bool) -> list[dict[str, Any]]:
    """Each mesh serves the same greedy batch: tokens must equal 1x1's; throughput and memory."""
    from jaxserve import LLM, SamplingParams, parallel

    prompts = [[1] + [(17 * i + 31 * j) % 4000 + 100 for j in range(24 + 8 * (i % 4))] for i in range(16 if quick else 64)]
    params = SamplingParams(max_tokens=16 if quick else 64, temperature=0.0, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    reference = None
    for mesh in meshes:
        try:
            t0 = time.perf_counter()
            llm = LLM(mesh=mesh, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512,
                      show_progress=False)
            startup = time.perf_counter() - t0
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        except Exception as e:  # report and go on: one failing mesh must not hide the others
            rows.append(dict(mesh=mesh, error=f"{type(e).__name__}: {e}"))
            print(f"  {mesh}: FAILED {type(e).__name__}: {e}")
            continue
        tokens = [o.outputs[0].token_ids for o in outs]
        reference = tokens if reference is None else reference
        weights = parallel.per_device_bytes(list(llm.engine.runner.model.param_arrays().values()))
        row = dict(mesh=mesh, ok=tokens == reference, startup_s=startup,
                   output_tok_s=sum(len(t) for t in tokens) / wall,
                   weights_per_device_MiB=max(weights.values()) / 2**20)
        rows.append(row)
        print(f"  {mesh}: equal to the first mesh that ran: {row['ok']}, {row['output_tok_s']:.1f} output tok/s, "
              f"start-up {startup:.1f} s, weights {row['weights_per_device_MiB']:.1f} MiB/device")
        del llm
    return rows


def default_meshes() -> list[str]:
    n = jax.device_count()
    if n < 2:
        return []
    tp = 1 << (min(n, 8).bit_length() - 1)
    return ["1x1", f"1x{tp}", f"{tp}x1"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("device_check.json"))
    ap.add_argument("--quick", action="store_true", help="fewer configs and iterations")
    ap.add_argument("--interpret", action="store_true", help="interpret-mode kernels on tiny shapes (CPU smoke run)")
    ap.add_argument("--meshes", default=None, help="comma list, e.g. 1x1,1x4 (default: 1x1,1xN,Nx1 if N>1 devices)")
    a = ap.parse_args()
    start = time.time()
    platform = jax.default_backend()
    kind = jax.devices()[0].device_kind
    kernels = kernels_for(platform, a.interpret)
    print(f"jax {jax.__version__} platform={platform} device_kind={kind} peak_bw={peak_bandwidth(kind)} "
          f"kernels={list(kernels)}")
    print("correctness vs XLA reference:")
    correctness = check_correctness(kernels, a.interpret)
    print("decode benchmark:")
    bench = bench_decode(kernels, kind, a.quick, a.interpret, start)
    print_table(bench, list(kernels))
    meshes = a.meshes.split(",") if a.meshes else default_meshes()
    mesh_rows = []
    if meshes:
        print(f"multi-device ({jax.device_count()} devices):")
        mesh_rows = check_meshes(meshes, a.quick)
    ok = all(r["ok"] for r in correctness) and all(r.get("ok", False) for r in mesh_rows)
    report = dict(jax_version=jax.__version__, platform=platform, device_kind=kind,
                  peak_bandwidth_Bps=peak_bandwidth(kind), interpret=a.interpret, quick=a.quick,
                  correctness=correctness, decode=bench, meshes=mesh_rows, all_correct=ok,
                  wall_s=time.time() - start)
    a.out.write_text(json.dumps(report, indent=2))
    print(f"{'PASS' if ok else 'FAIL'}: wrote {a.out} in {report['wall_s']:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
