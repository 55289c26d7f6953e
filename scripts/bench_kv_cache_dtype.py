"""The KV cache's dtype on the default model, in one run: float32 (the model's) against int8 and
fp8 e4m3 KV (--kv-cache-dtype).

    python scripts/bench_kv_cache_dtype.py --out docs/results/bench_kv_cache_dtype.json

For each: pages and tokens in a 1 GiB KV budget (--kv-cache-memory), sequences of --context tokens that fit, offline
throughput (128 requests, prompts 10-160 tokens, outputs 32-128, greedy, EOS ignored), and for the
8-bit pools the teacher-forced disagreement with float32 KV on tests/data/quant_texts.json (argmax
agreement, |d log p| of the text's next token). bfloat16 KV: its page count only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_offline import make_prompts  # noqa: E402
from bench_quant import disagreement  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402


def text_logits(llm: LLM) -> tuple[list, list]:
    from model_utils import prefill_logits

    tok = llm.get_tokenizer()
    ids = [tok(t).input_ids for t in json.loads((ROOT / "tests" / "data" / "quant_texts.json").read_text())]
    runner = llm.engine.runner
    kv_dtype = runner.kv_dtype if runner.kv_scales is not None else None
    return ids, prefill_logits(runner.model, ids, kv_dtype=kv_dtype, kv_scales=runner.kv_scales)


def run(kv_dtype: str, args, measure: bool) -> dict:
    t0 = time.perf_counter()
    llm = LLM(kv_cache_dtype=kv_dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=512, max_model_len=args.context, enable_prefix_caching=False,
              compile_ahead=measure, show_progress=False)
    e = llm.engine
    r: dict = dict(startup_seconds=time.perf_counter() - t0, pool_dtype=e.kv_dtype.name, pages=e.num_pages - 1,
                   tokens=(e.num_pages - 1) * e.pool.page_size, pool_bytes=e.runner.kv_cache_bytes)
    r["sequences_of_context"] = r["tokens"] // args.context
    if measure:
        tok = llm.get_tokenizer()
        prompts = make_prompts(tok, args.num_prompts, 10, 160, args.seed)
        rng = np.random.default_rng(args.seed + 1)
        params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True)
                  for n in rng.integers(32, 129, args.num_prompts)]
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        r["offline"] = dict(seconds=dt, output_tokens=n, tok_per_s=n / dt, compiles_after_warmup=e.compiles_after_warmup,
                            preemptions=e.scheduler.num_preemptions)
        r["outputs"] = [o.outputs[0].token_ids for o in outs]
        r["text_ids"], r["text_logits"] = text_logits(llm)
    del llm, e
    gc.collect()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048, help="max_model_len, and the sequence length counted")
    ap.add_argument("--kv-cache-memory", type=float, default=1.0,
                    help="GiB of KV pool; small values (0.1) make the budget bind, so preemption shows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args()
    results: dict = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "args": vars(args)}
    t0 = time.perf_counter()
    measured = ("auto", "int8", "fp8_e4m3")
    runs = {k: run(k, args, measure=True) for k in measured}
    runs["bfloat16"] = run("bfloat16", args, measure=False)
    for k in ("int8", "fp8_e4m3"):
        runs[k]["vs_float32"] = disagreement(runs["auto"], runs[k])
    for r in runs.values():
        for k in ("outputs", "text_ids", "text_logits"):
            r.pop(k, None)
    results.update(runs)
    print(f"\ndefault model (SmolLM2-135M, float32 weights), {results['machine']}; {args.kv_cache_memory} GiB KV; offline: "
          f"{args.num_prompts} requests, greedy, max_num_seqs {args.max_num_seqs}")
    print(f"{'kv cache':10s} {'pool':>8s} {'pages':>7s} {'tokens':>9s} {'seqs@' + str(args.context):>10s} "
          f"{'offline tok/s':>14s} {'vs f32':>7s} {'preempt':>8s}  teacher-forced vs f32 KV")
    base = runs["auto"]["offline"]["tok_per_s"]
    for k, r in runs.items():
        off = r.get("offline")
        d = r.get("vs_float32")
        print(f"{k:10s} {r['pool_dtype']:>8s} {r['pages']:7d} {r['tokens']:9d} {r['sequences_of_context']:10d} "
              + (f"{off['tok_per_s']:14.1f} {off['tok_per_s'] / base:6.2f}x {off['preemptions']:8d}" if off
                 else f"{'-':>14s} {'-':>7s} {'-':>8s}")
              + (f"  disagree {100 * d['teacher_forced_disagreement']:.2f}% of {d['text_tokens']}, mean |d log p| "
                 f"{d['dlogp_mean']:.3f} (max {d['dlogp_max']:.2f}); free-running {d['free_running_identical']} "
                 f"identical" if d else ""))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
