"""Offline throughput: jaxserve continuous vs static batching vs HF transformers, in one run.

    python scripts/bench_offline.py --out docs/results/bench_offline.json

By default 128 requests over 32 sequence slots for every system (our continuous and static
batching, HF static batches of 32): with more requests than slots, continuous batching refills a
slot as soon as a request ends, while a static batch waits for its longest answer. Each system generates the same seeded prompts greedily with EOS ignored, each request with its own
seeded output length, so every system produces the same useful tokens (a static HF batch runs to
its longest answer; only the requested tokens count). Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxserve import LLM, SamplingParams  # noqa: E402


def make_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    words = ("the of and to in is was for on that with as by at from his her an which or are this "
             "city river music science history garden window winter summer story people market").split()
    text = " ".join(rng.choice(words, 4 * max_len))
    ids = tokenizer(text).input_ids
    out = []
    for _ in range(num):
        n = int(rng.integers(min_len, max_len + 1))
        start = int(rng.integers(0, len(ids) - n))
        out.append(ids[start: start + n])
    return out


SAMPLED = dict(temperature=0.8, top_p=0.95)  # --sampled: what clients that do not ask for greedy get


def bench_jaxserve(llm: LLM, prompts, output_lens: list[int], repeats: int, sampled: bool = False) -> dict:
    opts = [dict(SAMPLED, seed=i) for i in range(len(output_lens))] if sampled else [dict(temperature=0.0)] * len(output_lens)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **o) for n, o in zip(output_lens, opts)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    t = statistics.median(times)
    # Host share of decode-only steps at the largest batch seen.
    decode = [(s, host, total) for s, n, host, total in llm.engine.step_timings if s == n]
    top = max((s for s, _, _ in decode), default=0)
    host_share = statistics.median(h / tot for s, h, tot in decode if s == top) if decode else float("nan")
    return dict(seconds=t, output_tokens=tokens, tok_per_s=tokens / t, compiles_after_warmup=llm.engine.compiles_after_warmup,
                decode_batch=top, decode_host_share=host_share, outputs=[o.outputs[0].token_ids for o in outs])


def bench_hf(prompts, output_lens: list[int], batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.loading import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    tokens = 0
    outputs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i: i + batch]
        output_len = max(output_lens[i: i + batch])  # a static batch runs as long as its longest answer
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False, pad_token_id=0)
        for row, want in zip(out[:, width:].tolist(), output_lens[i: i + batch]):
            outputs.append(row[:want])
            tokens += want  # useful tokens only
    t = time.perf_counter() - t0
    return dict(seconds=t, output_tokens=tokens, tok_per_s=tokens / t, outputs=outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--min-input-len", type=int, default=32)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--min-output-len", type=int, default=16)
    ap.add_argument("--max-output-len", type=int, default=160)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--hf-batch", type=int, default=32, help="HF static batch size (0: skip HF)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--sampled", action="store_true",
                    help="also run continuous batching with temperature 0.8, top_p 0.95 (seeded per request)")
    ap.add_argument("--sync", action="store_true",
                    help="also run continuous batching with the synchronous engine (--no-async-scheduling)")
    ap.add_argument("--no-static", action="store_true", help="skip the static-batching run")
    args = ap.parse_args()

    results: dict = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "args": vars(args)}
    common = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=1024, enable_prefix_caching=False)
    t0 = time.perf_counter()
    llm = LLM(**common)
    results["startup_seconds"] = time.perf_counter() - t0  # cold or warm compile cache: see --note
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.min_input_len, args.max_input_len, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    output_lens = [int(n) for n in rng.integers(args.min_output_len, args.max_output_len + 1, args.num_prompts)]
    t0 = time.perf_counter()
    results["jaxserve_continuous"] = bench_jaxserve(llm, prompts, output_lens, args.repeats)
    if args.sampled:
        results["jaxserve_continuous_sampled"] = bench_jaxserve(llm, prompts, output_lens, args.repeats, sampled=True)
    if args.sync:
        llm.engine.overlap = False
        results["jaxserve_continuous_sync"] = bench_jaxserve(llm, prompts, output_lens, args.repeats)
        llm.engine.overlap = True
    if not args.no_static:
        for replica in llm.engine.replicas:
            replica.scheduler.static = True
        results["jaxserve_static"] = bench_jaxserve(llm, prompts, output_lens, args.repeats)
    if args.hf_batch:
        results["hf_transformers"] = bench_hf(prompts, output_lens, args.hf_batch)
    ref = results["jaxserve_continuous"]["outputs"]
    for name in ("jaxserve_continuous_sync", "jaxserve_static", "hf_transformers"):
        if name in results:
            same = sum(a == b for a, b in zip(ref, results[name]["outputs"]))
            results[name]["identical_to_continuous"] = f"{same}/{len(ref)}"
    print(f"\n{args.num_prompts} prompts, input {args.min_input_len}-{args.max_input_len} tokens, "
          f"output {args.min_output_len}-{args.max_output_len} tokens (ignore_eos), greedy unless named, f32, {results['machine']}")
    print(f"start-up (load + compile {len(llm.engine.buckets.all())} buckets): {results['startup_seconds']:.1f} s")
    print(f"{'system':24s} {'seconds':>9s} {'out tok/s':>10s}  same outputs as continuous")
    names = ("jaxserve_continuous", "jaxserve_continuous_sampled", "jaxserve_continuous_sync", "jaxserve_static",
             "hf_transformers")
    for name in names:
        if name in results:
            r = results[name]
            print(f"{name:24s} {r['seconds']:9.2f} {r['tok_per_s']:10.1f}  {r.get('identical_to_continuous', '-')}")
    base = results["jaxserve_continuous"]["tok_per_s"]
    for name in names[1:]:
        if name in results:
            print(f"continuous / {name}: {base / results[name]['tok_per_s']:.2f}x")
    c = results["jaxserve_continuous"]
    print(f"decode step at batch {c['decode_batch']}: host (schedule + inputs) {100 * c['decode_host_share']:.1f}% of the step")
    print(f"compilations after warm-up: {results['jaxserve_continuous']['compiles_after_warmup']}; "
          f"total bench time {time.perf_counter() - t0:.0f} s")
    for r in results.values():
        if isinstance(r, dict):
            r.pop("outputs", None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
