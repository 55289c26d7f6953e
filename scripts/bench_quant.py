"""float32 vs --quantization int8 vs --quantization gguf on the default model, in one run.

    python scripts/bench_quant.py --out docs/results/bench_quant.json

For each: weight bytes, start-up, offline throughput (128 requests, prompts 10-160 tokens, outputs
32-128, greedy, EOS ignored, continuous batching), decode tok/s at concurrency 1 and 8 (128 output
tokens each), and, for the quantized ones, greedy disagreement with float32: teacher-forced (argmax
at every position of a fixed text set, tests/data/quant_texts.json) and free-running (the offline
outputs). Prints a table and writes JSON (--out). The default model's float32 weights are its
Q4_1 file dequantized, so `gguf` (the same weights, never dequantized) should agree exactly.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_offline import make_prompts  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402

DECODE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def decode_rate(llm: LLM, concurrency: int, tokens: int, repeats: int) -> float:
    """Output tok/s of `concurrency` identical-length greedy streams (a short prompt each)."""
    tok = llm.get_tokenizer()
    ids = tok(DECODE_PROMPT).input_ids
    prompts = [ids + [i + 10] for i in range(concurrency)]  # distinct, so no prefix sharing at all
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    return statistics.median(rates)


def text_logits(llm: LLM) -> list[np.ndarray]:
    from model_utils import prefill_logits

    tok = llm.get_tokenizer()
    texts = json.loads((ROOT / "tests" / "data" / "quant_texts.json").read_text())
    ids = [tok(t).input_ids for t in texts]
    return ids, prefill_logits(llm.engine.runner.model, ids)


def run(quantization: str, prompts_fn, args) -> dict:
    t0 = time.perf_counter()
    llm = LLM(quantization=quantization, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512,
              max_model_len=1024, enable_prefix_caching=False, show_progress=False)
    r: dict = dict(startup_seconds=time.perf_counter() - t0, weight_bytes=llm.engine.weight_bytes,
                   impl=llm.engine.runner.model.quant_impl if quantization != "none" else "xla f32")
    prompts, output_lens = prompts_fn(llm.get_tokenizer())
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    r["offline"] = dict(seconds=dt, output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                        tok_per_s=sum(len(o.outputs[0].token_ids) for o in outs) / dt,
                        compiles_after_warmup=llm.engine.compiles_after_warmup)
    r["outputs"] = [o.outputs[0].token_ids for o in outs]
    for c in (1, 8):
        r[f"decode_c{c}_tok_per_s"] = decode_rate(llm, c, args.decode_tokens, args.repeats)
    r["text_ids"], r["text_logits"] = text_logits(llm)
    del llm
    gc.collect()
    return r


def disagreement(f32: dict, q8: dict) -> dict:
    import jax

    agree, dlogp = [], []
    for ids, a, b in zip(f32["text_ids"], f32["text_logits"], q8["text_logits"]):
        agree.append(a[:-1].argmax(-1) == b[:-1].argmax(-1))
        la, lb = np.asarray(jax.nn.log_softmax(a, -1)), np.asarray(jax.nn.log_softmax(b, -1))
        t = np.asarray(ids[1:])[:, None]
        dlogp.append(np.abs(np.take_along_axis(la[:-1], t, 1) - np.take_along_axis(lb[:-1], t, 1))[:, 0])
    agree, dlogp = np.concatenate(agree), np.concatenate(dlogp)
    first_diff = []
    for x, y in zip(f32["outputs"], q8["outputs"]):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        first_diff.append(len(x) if n is None else n)
    same = sum(x == y for x, y in zip(f32["outputs"], q8["outputs"]))
    tokens_before = sum(first_diff) / sum(len(x) for x in f32["outputs"])
    return dict(text_tokens=int(len(agree)), teacher_forced_disagreement=float(1 - agree.mean()),
                dlogp_mean=float(dlogp.mean()), dlogp_max=float(dlogp.max()),
                free_running_identical=f"{same}/{len(f32['outputs'])}",
                free_running_share_before_first_divergence=float(tokens_before))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--min-input-len", type=int, default=10)
    ap.add_argument("--max-input-len", type=int, default=160)
    ap.add_argument("--min-output-len", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="decode runs per concurrency (median)")
    ap.add_argument("--methods", default="int8,gguf", help="quantizations to compare with float32, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args()

    def prompts_fn(tokenizer):
        prompts = make_prompts(tokenizer, args.num_prompts, args.min_input_len, args.max_input_len, args.seed)
        rng = np.random.default_rng(args.seed + 1)
        return prompts, [int(n) for n in rng.integers(args.min_output_len, args.max_output_len + 1, args.num_prompts)]

    results: dict = {"machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.processor() or ''}".strip(", "),
                     "args": vars(args)}
    t0 = time.perf_counter()
    methods = ["none", *args.methods.split(",")]
    runs = {q: run(q, prompts_fn, args) for q in methods}
    names = {q: "float32" if q == "none" else q for q in methods}
    for q in methods:
        results[names[q]] = runs[q]
        if q != "none":
            runs[q]["vs_float32"] = disagreement(runs["none"], runs[q])
    for r in runs.values():
        for k in ("outputs", "text_ids", "text_logits"):
            r.pop(k)
    f = runs["none"]
    print(f"\ndefault model (SmolLM2-135M from its Q4_1 GGUF), {results['machine']}; offline: {args.num_prompts} "
          f"requests, input {args.min_input_len}-{args.max_input_len}, output {args.min_output_len}-"
          f"{args.max_output_len} tokens, greedy, max_num_seqs {args.max_num_seqs}")
    quantized = methods[1:]
    print(f"{'':28s} {'float32':>10s}" + "".join(f" {names[q]:>10s} {'/f32':>6s}" for q in quantized))
    rows = [("weights MiB", lambda r: r["weight_bytes"] / 2**20),
            ("start-up s", lambda r: r["startup_seconds"]),
            ("offline out tok/s", lambda r: r["offline"]["tok_per_s"]),
            (f"decode c1 tok/s ({args.decode_tokens})", lambda r: r["decode_c1_tok_per_s"]),
            (f"decode c8 tok/s ({args.decode_tokens})", lambda r: r["decode_c8_tok_per_s"])]
    for name, get in rows:
        print(f"{name:28s} {get(f):10.1f}" + "".join(f" {get(runs[q]):10.1f} {get(runs[q]) / get(f):5.2f}x"
                                                   for q in quantized))
    for q in quantized:
        d = runs[q]["vs_float32"]
        print(f"{names[q]} vs float32: teacher-forced greedy disagreement {100 * d['teacher_forced_disagreement']:.2f}% "
              f"of {d['text_tokens']} text tokens, mean |d log p| {d['dlogp_mean']:.2g} (max {d['dlogp_max']:.2g}); "
              f"free-running: {d['free_running_identical']} outputs identical, "
              f"{100 * d['free_running_share_before_first_divergence']:.1f}% of tokens before the first divergence; "
              f"linear layers on {runs[q]['impl']}")
    print("compiles after warm-up: " + ", ".join(f"{names[q]} {runs[q]['offline']['compiles_after_warmup']}"
                                                 for q in methods) + f"; total {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
