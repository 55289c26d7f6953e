#!/usr/bin/env python
"""Device check of the Pallas ragged paged attention kernels, for one GPU (H200) or one TPU.

    python scripts/device_check.py --out $OUT/device_check.json      # on the device, < 5 minutes
    python scripts/device_check.py --interpret --quick --out /tmp/dc.json   # CPU smoke run

Needs only jax (+ numpy) for the kernel sections; the engine section also needs the project's
own dependencies (flax, transformers, safetensors, tokenizers) and reports an error without them.

1. Correctness against the XLA reference (jaxserve/attention.py) at the SmolLM2 shape (9 q / 3 KV
   heads, head_dim 64) and a Llama-3-8B shape (32 / 8, head_dim 128): decode only, prefill chunks
   with prior context, a mixed batch, a mixed batch with a sliding window (+ soft cap), in bf16,
   and mixed in f32.
2. Device time, not dispatch: each timed call runs the kernel N times inside one jit (a fori_loop
   whose trip count is an argument, the output fed into the next query so nothing is hoisted);
   time(N2) - time(N1) over N2 - N1 is the per-call device time. Decode (batch x context) and
   prefill / mixed steps, with achieved HBM bandwidth (the bytes the kernel must move: every
   sequence's K and V once, q in, out) and FLOP/s (4 x attended pairs x heads x head_dim) as a
   fraction of the chip's peak.
3. A small block-size sweep on one decode and one prefill step.
4. One end-to-end engine run on the single device: a tiny random Llama written as an HF checkpoint,
   a handful of buckets, greedy outputs of the Pallas backend compared with the XLA reference backend.
5. Several devices (or --meshes): the default model on meshes 1x1, 1xN, Nx1 (tokens equal to 1x1).

PASS only if every case passed: a correctness case, a benchmark (any error there fails the run),
the sweep, the engine run and the meshes. JSON to --out; a compact summary in the last lines.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.attention import ragged_paged_attention_xla  # noqa: E402
from jaxserve.pallas_kernels import ragged_paged_attention_gpu, ragged_paged_attention_tpu  # noqa: E402

# Peak HBM bandwidth (B/s) and dense bf16 matmul FLOP/s by device_kind substring; first match wins.
# Published figures: H200 4.8 TB/s, 989 TFLOP/s (SXM, dense); H100 SXM 3.35 TB/s, 989; A100 2.0, 312;
# TPU v5e 819 GB/s, 197; v5p 2765 GB/s, 459; v6e (Trillium) 1640 GB/s, 918; v4 1228 GB/s, 275.
PEAKS = [("H200", 4.8e12, 989e12), ("H100", 3.35e12, 989e12), ("A100", 2.0e12, 312e12), ("L4", 0.3e12, 121e12),
         ("TPU v5 lite", 819e9, 197e12), ("TPU v5e", 819e9, 197e12), ("TPU v5p", 2765e9, 459e12),
         ("TPU v5", 2765e9, 459e12), ("TPU v6", 1640e9, 918e12), ("TPU v4", 1228e9, 275e12)]
BUDGET_S = 200.0  # on a device, benchmarks past this are skipped (and reported so); the engine run still goes

SMOL = dict(kv_heads=3, group=3, head_dim=64)
LLAMA = dict(kv_heads=8, group=4, head_dim=128)


def peaks(kind: str) -> tuple[float | None, float | None]:
    return next(((bw, fl) for k, bw, fl in PEAKS if k.lower() in kind.lower()), (None, None))


def kernels_for(platform: str, interpret: bool) -> dict[str, Callable[..., jax.Array]]:
    if interpret:
        return {
            "gpu_interpret": lambda *a, **k: ragged_paged_attention_gpu(*a, **{"block_q": 16, "block_kv": 16,
                                                                            "split_tokens": 32, **k}, interpret=True),
            "tpu_interpret": lambda *a, **k: ragged_paged_attention_tpu(*a, **{"block_q": 8, "pages_per_block": 2,
                                                                            **k}, interpret=True),
        }
    if platform == "tpu":
        out: dict[str, Callable[..., jax.Array]] = {"tpu": ragged_paged_attention_tpu}
        if "kv_split" in inspect.signature(ragged_paged_attention_tpu).parameters:
            out["tpu_indexed"] = lambda *a, **k: ragged_paged_attention_tpu(*a, **k, kv_split="indexed")
        return out
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


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


# ---- 1. correctness ---------------------------------------------------------------------------
def correctness_cases(interpret: bool, quick: bool = False) -> list[dict[str, Any]]:
    s = 1 if interpret else 8  # context / chunk scale: small interpreted, realistic on a device
    cases = []
    for shape_name, shape in (("smollm2", SMOL), ("llama3_8b", LLAMA)):
        dec = dict(q_lens=[1] * 6, kv_lens=[1, 15, 16, 17, 40 * s, 97 * s])
        pre = dict(q_lens=[9 * s, 16 * s, 5], kv_lens=[9 * s, 40 * s, 70 * s])  # the last two: prior context
        mix = dict(q_lens=[1, 1, 7 * s, 1, 12 * s], kv_lens=[1, 33 * s, 40 * s, 65, 12 * s])
        for name, c, kw in (("decode", dec, {}), ("prefill", pre, {}), ("mixed", mix, {}),
                            ("mixed_swa_cap", mix, dict(sliding_window=16 * s, soft_cap=30.0))):
            cases.append(dict(name=f"{shape_name}_{name}_bf16", **c, page_size=16, **shape, dtype=jnp.bfloat16,
                              kw=kw, tol=3e-2))
        cases.append(dict(name=f"{shape_name}_mixed_f32", **mix, page_size=16 if shape is SMOL else 32, **shape,
                          dtype=jnp.float32, kw={}, tol=1e-5 if interpret else 2e-5))
    if interpret and quick:  # a CPU smoke run: the cases that cover the most paths at once
        cases = [c for c in cases if c["name"].endswith(("mixed_swa_cap_bf16", "mixed_f32"))]
    return cases


def check_correctness(kernels: dict[str, Callable[..., jax.Array]], interpret: bool,
                      quick: bool = False) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    results = []
    for c in correctness_cases(interpret, quick):
        args, rows = make_batch(rng, c["q_lens"], c["kv_lens"], page_size=c["page_size"], kv_heads=c["kv_heads"],
                                group=c["group"], head_dim=c["head_dim"], dtype=c["dtype"])
        kw = dict(sm_scale=c["head_dim"] ** -0.5, **c["kw"])
        with jax.default_matmul_precision("highest"):  # the oracle must not use TF32/bf16 passes
            ref = jax.jit(lambda *a: ragged_paged_attention_xla(*a, **kw))(*args)
        for name, fn in kernels.items():
            try:
                out = jax.block_until_ready(jax.jit(lambda *a: fn(*a, **kw))(*args))
            except Exception as e:  # noqa: BLE001 - report and go on: the run is unattended
                results.append(dict(case=c["name"], kernel=name, error=_err(e), ok=False))
                print(f"  {c['name']:<26} {name:<14} FAILED: {_err(e)[:300]}")
                continue
            err = rel_err(out, ref)
            pad_ok = not np.asarray(out[rows:], np.float32).any()
            finite = bool(np.isfinite(np.asarray(out, np.float32)).all())
            ok = bool(err <= c["tol"] and pad_ok and finite)
            results.append(dict(case=c["name"], kernel=name, rel_err=err, tol=c["tol"], padding_zero=pad_ok,
                                finite=finite, ok=ok))
            print(f"  {c['name']:<26} {name:<14} rel_err={err:.2e} (tol {c['tol']:.0e}) "
                  f"padding_zero={pad_ok} {'ok' if ok else 'FAIL'}")
    return results


# ---- 2. device-time benchmarks ----------------------------------------------------------------
def device_time(fn: Callable[..., jax.Array], args: tuple, iters: tuple[int, int]) -> float:
    """Seconds per kernel call on the device: N calls chained inside one jit, two N's differenced."""
    q0, rest = args[0], args[1:]

    @jax.jit
    def looped(n, q, *rest):
        def body(_, q):
            out = fn(q, *rest)
            return (q + out * 1e-3).astype(q.dtype)  # a data dependency: no call can be hoisted or fused away
        return jax.lax.fori_loop(0, n, body, q)

    def run(n: int) -> float:
        jax.block_until_ready(looped(n, q0, *rest))  # compiled once (n is traced); warm
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(looped(n, q0, *rest))
            best = min(best, time.perf_counter() - t0)
        return best

    n1, n2 = iters
    t1, t2 = run(n1), run(n2)
    if t2 - t1 < 0.05 * t2:  # the difference is lost in noise (loaded CPU): an upper bound instead
        return t2 / n2
    return (t2 - t1) / (n2 - n1)


def step_costs(q_lens: list[int], kv_lens: list[int], shape: dict[str, int], itemsize: int,
               sliding_window: int | None = None) -> tuple[int, int]:
    """(bytes, flops) the step needs at least: each sequence's K/V once (the window's part), q, out;
    4 flops per attended (query, key) pair per head per head_dim (q.k and p.v)."""
    kvh, g, d = shape["kv_heads"], shape["group"], shape["head_dim"]
    kv_read = pairs = 0
    for ql, kl in zip(q_lens, kv_lens):
        first = kl - ql
        spans = [min(first + i + 1, sliding_window or 1 << 62) for i in range(ql)]
        pairs += sum(spans)
        kv_read += min(kl, (sliding_window or kl) + ql - 1)
    nbytes = (kv_read * 2 * kvh * d + 2 * sum(q_lens) * kvh * g * d) * itemsize
    return nbytes, 4 * pairs * kvh * g * d


def bench(kernels: dict[str, Callable[..., jax.Array]], kind: str, quick: bool, interpret: bool,
          start: float) -> list[dict[str, Any]]:
    bw_peak, fl_peak = peaks(kind)
    if interpret:
        shape, iters = dict(SMOL), (1, 3)
        steps = [("decode", [1] * 2, [64] * 2), ("prefill", [32], [48]), ("mixed", [1, 1, 16], [40, 64, 16])]
    else:
        shape, iters = dict(LLAMA), (4, 24)
        # 8000, not 8192: at batch 128 an 8K pool (+ the null page) passes the 2^31 elements the
        # GPU kernel addresses with int32 offsets, and the kernel refuses it (docs/kernels.md).
        batches, contexts = ([8, 128], [512, 8000]) if quick else ([8, 32, 128], [512, 2048, 8000])
        steps = [("decode", [1] * b, [c] * b) for b in batches for c in contexts]
        steps += [("prefill", [512] * 4, [512] * 4), ("prefill_ctx", [512] * 4, [4096] * 4),
                  ("mixed", [1] * 120 + [256] * 2, [2048] * 120 + [1024] * 2)]
    if interpret:  # timing the TPU interpreter (host callbacks per DMA) would measure nothing
        kernels = {k: v for k, v in kernels.items() if k.startswith("gpu")}
        steps = steps[:2] if quick else steps
    dtype = jnp.bfloat16
    rng = np.random.default_rng(1)
    rows = []
    for name, q_lens, kv_lens in steps:
        row: dict[str, Any] = dict(step=name, batch=len(q_lens), tokens=sum(q_lens), max_context=max(kv_lens))
        if time.time() - start > BUDGET_S:
            row["skipped"] = "time budget"
            rows.append(row)
            print(f"  {name} b{len(q_lens)} ctx{max(kv_lens)}: skipped (time budget)")
            continue
        args, _ = make_batch(rng, q_lens, kv_lens, page_size=16, **shape, dtype=dtype, pad_seqs=0)
        nbytes, flops = step_costs(q_lens, kv_lens, shape, 2)
        row.update(bytes=nbytes, flops=flops)
        kw = dict(sm_scale=shape["head_dim"] ** -0.5)
        for kname, fn in kernels.items():
            try:
                t = device_time(lambda *a, fn=fn: fn(*a, **kw), args, iters)
            except Exception as e:  # noqa: BLE001 - recorded, and it fails the run
                row[f"{kname}_error"] = _err(e)
                print(f"  {name} {kname} FAILED: {_err(e)[:300]}")
                continue
            row[f"{kname}_us"] = t * 1e6
            row[f"{kname}_GBps"] = nbytes / t / 1e9
            row[f"{kname}_TFLOPs"] = flops / t / 1e12
            row[f"{kname}_pct_bw"] = None if bw_peak is None else 100 * nbytes / t / bw_peak
            row[f"{kname}_pct_flops"] = None if fl_peak is None else 100 * flops / t / fl_peak
        # The reference's time, for context only, where it is cheap (it materialises scores).
        if interpret or (not quick and len(q_lens) <= 32 and max(kv_lens) <= 2048):
            try:
                row["xla_ref_us"] = device_time(lambda *a: ragged_paged_attention_xla(*a, **kw), args, iters) * 1e6
            except Exception as e:  # noqa: BLE001 - not a kernel error
                row["xla_ref_note"] = _err(e)[:300]
        rows.append(row)
        print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                               if not k.endswith("_note")))
    return rows


def sweep(platform: str, interpret: bool, start: float, wide: bool = False) -> list[dict[str, Any]]:
    """A few block sizes on one decode and one prefill step (device time, correctness vs the default).
    `wide` (GPU): more KV blocks and pipeline stages, at the decode roofline's shape too."""
    if wide and platform == "gpu" and not interpret:
        shape, iters = dict(LLAMA), (4, 24)
        steps = [("decode_b128_ctx8000", [1] * 128, [8000] * 128), ("decode", [1] * 64, [4096] * 64),
                 ("prefill", [512] * 4, [1024] * 4)]
        configs = ([dict(block_q=64, block_kv=bkv, num_stages=ns) for bkv in (32, 64, 128, 256) for ns in (2, 3)]
                   + [dict(block_q=128, block_kv=bkv) for bkv in (32, 64, 128)])
        return _sweep_rows(ragged_paged_attention_gpu, shape, iters, steps, configs, start)
    if interpret:
        shape, iters, steps = dict(SMOL), (1, 3), [("decode", [1] * 2, [64] * 2), ("prefill", [32], [48])]
    else:
        shape, iters = dict(LLAMA), (4, 24)
        steps = [("decode", [1] * 64, [4096] * 64), ("prefill", [512] * 4, [1024] * 4)]
    if platform == "tpu" and not interpret:
        configs = [dict(block_q=bq, pages_per_block=pb) for bq, pb in ((32, 8), (32, 16), (64, 16), (32, 32))]
        fn = ragged_paged_attention_tpu
    else:
        configs = [dict(block_q=bq, block_kv=bkv) for bq, bkv in ((32, 64), (64, 32), (64, 64), (64, 128), (128, 64))]
        fn = (lambda *a, **k: ragged_paged_attention_gpu(*a, **k, interpret=True)) if interpret \
            else ragged_paged_attention_gpu
        if interpret:
            configs = configs[:2]
            steps = steps[:1]
    return _sweep_rows(fn, shape, iters, steps, configs, start)


def _sweep_rows(fn: Callable[..., jax.Array], shape: dict[str, int], iters: tuple[int, int], steps: list,
                configs: list[dict[str, int]], start: float) -> list[dict[str, Any]]:
    rng = np.random.default_rng(2)
    rows = []
    for name, q_lens, kv_lens in steps:
        args, real = make_batch(rng, q_lens, kv_lens, page_size=16, **shape, dtype=jnp.bfloat16, pad_seqs=0)
        kw = dict(sm_scale=shape["head_dim"] ** -0.5)
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda *a: ragged_paged_attention_xla(*a, **kw))(*args)
        for cfg in configs:
            row: dict[str, Any] = dict(step=name, **cfg)
            if time.time() - start > BUDGET_S + 20:
                row["skipped"] = "time budget"
                rows.append(row)
                continue
            try:
                f = lambda *a, cfg=cfg: fn(*a, **kw, **cfg)  # noqa: E731
                row["rel_err"] = rel_err(jax.jit(f)(*args)[:real], ref[:real])
                row["us"] = device_time(f, args, iters) * 1e6
                row["GBps"] = step_costs(q_lens, kv_lens, shape, 2)[0] / row["us"] / 1e3
                row["ok"] = row["rel_err"] <= 3e-2
            except Exception as e:  # noqa: BLE001
                row.update(error=_err(e), ok=False)
            rows.append(row)
            print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                                   if k != "error") + (f"  FAILED: {row['error'][:200]}" if "error" in row else ""))
    return rows


# ---- 4. one engine run ------------------------------------------------------------------------
def write_tiny_checkpoint(path: Path, *, vocab: int = 256, hidden: int = 128, layers: int = 2, heads: int = 4,
                          kv_heads: int = 2, head_dim: int = 64, seed: int = 0, max_positions: int = 512) -> Path:
    """A random Llama as an HF checkpoint directory (config.json, safetensors, a word-level
    tokenizer), made with numpy alone: no torch, no hub."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    inter = 2 * hidden
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
               intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)  # wide logits: clear greedy margins

    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32),
         "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": np.ones(hidden, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                  p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                  p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                  p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                  p + "mlp.down_proj.weight": w(hidden, inter)})
    save_file(t, str(path / "model.safetensors"))
    words = {f"t{i}": i for i in range(vocab)}
    words.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    tok = Tokenizer(models.WordLevel(vocab={k: v for k, v in words.items()}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>", unk_token="<unk>")))
    return path


def engine_run(platform: str, quick: bool) -> dict[str, Any]:
    """A tiny random model served on one device: Pallas backend vs the XLA reference backend."""
    t_start = time.perf_counter()
    try:
        from jaxserve import LLM, SamplingParams

        tmp = Path(tempfile.mkdtemp(prefix="jaxserve-devcheck-"))
        model = write_tiny_checkpoint(tmp / "tiny")
        prompts = [[1] + [(7 * i + 13 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(8)]
        params = SamplingParams(max_tokens=8 if quick else 24, temperature=0.0, ignore_eos=True)
        # A handful of buckets: tokens 16/32(/64) x one or two page buckets; prompts up to 68 tokens
        # are chunked over several steps.
        opts = dict(model=str(model), dtype="float32", max_num_seqs=8, max_num_batched_tokens=32 if quick else 64,
                    max_model_len=128 if quick else 256,
                    page_size=16, num_pages=128, enable_prefix_caching=False, compilation_cache_dir=None,
                    mesh="1x1", show_progress=False)
        out: dict[str, Any] = {}
        tokens = {}
        for backend in ("pallas", "xla-reference"):
            t0 = time.perf_counter()
            llm = LLM(**opts, attention_backend=backend)
            startup = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            tokens[backend] = [list(r.outputs[0].token_ids) for r in res]
            out[backend] = dict(startup_s=startup, generate_s=time.perf_counter() - t0,
                                buckets=len(llm.engine.buckets.all()),
                                compiles_after_warmup=getattr(llm.engine.runner, "compiles_after_warmup", None))
            del llm
        lengths_ok = all(len(t) == params.max_tokens for t in tokens["pallas"])
        same = sum(a == b for a, b in zip(tokens["pallas"], tokens["xla-reference"]))
        recompiles = out["pallas"]["compiles_after_warmup"] or 0  # every bucket compiled at start-up
        out.update(sequences=len(prompts), max_tokens=params.max_tokens, lengths_ok=lengths_ok,
                   sequences_equal_to_reference=same,
                   ok=bool(lengths_ok and same == len(prompts) and recompiles == 0),
                   wall_s=time.perf_counter() - t_start)
    except Exception as e:  # noqa: BLE001 - a missing dependency or a failure: reported, and the run fails
        traceback.print_exc()
        return dict(ok=False, error=_err(e), wall_s=time.perf_counter() - t_start)
    print(f"  pallas vs xla-reference: {same}/{len(prompts)} sequences equal, lengths ok {lengths_ok}; "
          f"start-up {out['pallas']['startup_s']:.1f} s ({out['pallas']['buckets']} buckets)")
    return out


# ---- 5. meshes --------------------------------------------------------------------------------
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
            llm = LLM(mesh=mesh, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512, show_progress=False)
            startup = time.perf_counter() - t0
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - one failing mesh must not hide the others
            rows.append(dict(mesh=mesh, error=_err(e), ok=False))
            print(f"  {mesh}: FAILED {_err(e)[:300]}")
            continue
        tokens = [o.outputs[0].token_ids for o in outs]
        reference = tokens if reference is None else reference
        weights = parallel.per_device_bytes(list(llm.engine.runner.model.param_arrays().values()))
        row = dict(mesh=mesh, ok=tokens == reference, startup_s=startup, output_tok_s=sum(len(t) for t in tokens) / wall,
                   weights_per_device_MiB=max(weights.values()) / 2**20)
        rows.append(row)
        print(f"  {mesh}: equal to the first mesh: {row['ok']}, {row['output_tok_s']:.1f} output tok/s, "
              f"start-up {startup:.1f} s, weights {row['weights_per_device_MiB']:.1f} MiB/device")
        del llm
    return rows


def default_meshes() -> list[str]:
    n = jax.device_count()
    if n < 2:
        return []
    tp = 1 << (min(n, 8).bit_length() - 1)
    return ["1x1", f"1x{tp}", f"{tp}x1"]


def summary_lines(report: dict[str, Any], kernels: list[str]) -> list[str]:
    corr = report["correctness"]
    lines = [f"correctness: {sum(r['ok'] for r in corr)}/{len(corr)} ok"
             + "".join(f"; FAIL {r['case']}/{r['kernel']}" for r in corr if not r["ok"])]
    for r in report["bench"]:
        if "skipped" in r:
            lines.append(f"{r['step']:<11} b{r['batch']:<4} ctx{r['max_context']:<6} skipped ({r['skipped']})")
            continue
        for k in kernels:
            if f"{k}_error" in r:
                lines.append(f"{r['step']:<11} b{r['batch']:<4} ctx{r['max_context']:<6} {k}: ERROR")
            elif f"{k}_us" in r:
                bw, fl = r[f"{k}_pct_bw"], r[f"{k}_pct_flops"]
                lines.append(f"{r['step']:<11} b{r['batch']:<4} ctx{r['max_context']:<6} {k}: {r[f'{k}_us']:9.1f} us "
                             f"{r[f'{k}_GBps']:7.1f} GB/s ({'n/a' if bw is None else f'{bw:.0f}%'} HBM) "
                             f"{r[f'{k}_TFLOPs']:6.2f} TFLOP/s ({'n/a' if fl is None else f'{fl:.0f}%'})")
    sw = report["sweep"]
    best = {}
    for r in sw:
        if "us" in r and (r["step"] not in best or r["us"] < best[r["step"]]["us"]):
            best[r["step"]] = r
    lines.append(f"sweep: {sum(r.get('ok', False) for r in sw)}/{len(sw)} ok; best "
                 + ", ".join(f"{s}: {', '.join(f'{k}={v}' for k, v in r.items() if k.startswith(('block', 'pages')))}"
                             f" {r['us']:.1f} us" for s, r in best.items()))
    e = report["engine"]
    lines.append("engine: " + (f"ERROR {e.get('error', '')[:200]}" if "error" in e else
                               f"{e['sequences_equal_to_reference']}/{e['sequences']} sequences equal to the reference, "
                               f"start-up {e['pallas']['startup_s']:.1f} s"))
    if report["meshes"]:
        lines.append("meshes: " + ", ".join(f"{m['mesh']} {'ok' if m.get('ok') else 'FAIL'}" for m in report["meshes"]))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("device_check.json"))
    ap.add_argument("--quick", action="store_true", help="fewer configs and iterations")
    ap.add_argument("--interpret", action="store_true", help="interpret-mode kernels on tiny shapes (CPU smoke run)")
    ap.add_argument("--meshes", default=None, help="comma list, e.g. 1x1,1x4 (default: 1x1,1xN,Nx1 if N>1 devices)")
    ap.add_argument("--sweep-wide", action="store_true", help="GPU: only a wider block-size sweep, to --out")
    ap.add_argument("--skip-engine", action="store_true", help="no engine run (it is then reported as not run: FAIL)")
    a = ap.parse_args()
    start = time.time()
    global BUDGET_S
    if a.interpret:  # a CPU smoke run is judged by finishing, not by the device budget
        BUDGET_S = 3600.0
    platform = jax.default_backend()
    kind = jax.devices()[0].device_kind
    kernels = kernels_for(platform, a.interpret)
    bw, fl = peaks(kind)
    print(f"jax {jax.__version__} platform={platform} device_kind={kind} peak_bw={bw} peak_flops={fl} "
          f"kernels={list(kernels)}", flush=True)
    report: dict[str, Any] = dict(jax_version=jax.__version__, python=sys.version.split()[0], platform=platform,
                                  device_kind=kind, peak_bandwidth_Bps=bw, peak_flops=fl, interpret=a.interpret,
                                  quick=a.quick)
    if a.sweep_wide:
        report["sweep_wide"] = sweep(platform, a.interpret, start, wide=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1, default=str))
        return 0
    print("1. correctness vs the XLA reference:", flush=True)
    t0 = time.time()
    # A quick CPU run checks the GPU kernel only: the TPU interpreter simulates every DMA through
    # host callbacks (minutes here) and has its own interpret tests in tests/test_pallas_kernels.py.
    checked = {k: v for k, v in kernels.items() if k.startswith("gpu")} if a.interpret and a.quick else kernels
    report["correctness"] = check_correctness(checked, a.interpret, a.quick)
    sections = {"correctness": time.time() - t0}
    print("2. device-time benchmarks (bf16, Llama-3-8B attention shape):", flush=True)
    t0 = time.time()
    report["bench"] = bench(kernels, kind, a.quick, a.interpret, start)
    sections["bench"] = time.time() - t0
    print("3. block-size sweep:", flush=True)
    t0 = time.time()
    report["sweep"] = sweep(platform, a.interpret, start)
    sections["sweep"] = time.time() - t0
    print("4. engine run (tiny random model, one device):", flush=True)
    t0 = time.time()
    report["engine"] = dict(ok=False, error="skipped (--skip-engine)") if a.skip_engine else engine_run(platform,
                                                                                                         a.quick)
    sections["engine"] = time.time() - t0
    report["section_seconds"] = sections
    meshes = a.meshes.split(",") if a.meshes else default_meshes()
    report["meshes"] = []
    if meshes:
        print(f"5. multi-device ({jax.device_count()} devices):", flush=True)
        report["meshes"] = check_meshes(meshes, a.quick)
    bench_errors = [f"{r['step']}/{k}" for r in report["bench"] for k in kernels if f"{k}_error" in r]
    ok = (all(r["ok"] for r in report["correctness"]) and not bench_errors
          and all(r.get("ok", False) for r in report["sweep"] if "skipped" not in r)
          and report["engine"].get("ok", False) and all(r.get("ok", False) for r in report["meshes"]))
    report.update(bench_errors=bench_errors, passed=ok, wall_s=time.time() - start)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2, default=str))
    print("\n== summary ==")
    for line in summary_lines(report, list(kernels)):
        print(line)
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in sections.items()))
    print(f"{'PASS' if ok else 'FAIL'}: {platform} {kind}, jax {jax.__version__}, {report['wall_s']:.0f} s, "
          f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
