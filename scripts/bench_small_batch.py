#!/usr/bin/env python
"""Small decode batches on CPU: step buckets from 1 row against the accelerator floor of 16.

XLA's CPU dot costs more with every row, so padding one decode row to a 16-row bucket is paid in
full; on accelerators a 16-row tile costs what one row does. For each smallest bucket
(--min-token-buckets) this builds the default model's engine (buckets compiled ahead, as the
server does, without the persistent compilation cache), then generates at each concurrency, greedy and sampled (temperature 1.0, OpenAI's
default), and reports the median output tok/s of --repeats runs and the start-up time.

    python scripts/bench_small_batch.py --out docs/results/bench_small_batch_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxserve import LLM, SamplingParams  # noqa: E402


def run(min_bucket: int, args) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model=args.model, max_num_seqs=max(args.concurrency), max_model_len=1024, min_token_bucket=min_bucket,
              show_progress=False, compilation_cache_dir=None)  # start-up includes every compile
    startup = time.perf_counter() - t0
    out = {"min_token_bucket": min_bucket, "token_buckets": list(llm.engine.buckets.token_buckets),
           "startup_s": startup, "tok_s": {}}
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        for conc in args.concurrency:
            rates = []
            for r in range(args.repeats):
                prompts = [f"Request {r}.{i}: write about the rivers, markets and music of an old city."
                           for i in range(conc)]
                params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True, seed=r)
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
            out["tok_s"][f"{mode} c{conc}"] = statistics.median(rates)
            print(f"min bucket {min_bucket:2d}  {mode:7s} concurrency {conc}: {statistics.median(rates):6.1f} tok/s "
                  f"(runs {', '.join(f'{x:.1f}' for x in rates)})", flush=True)
    llm.engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--min-token-buckets", default="16,1")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    results = [run(int(m), args) for m in args.min_token_buckets.split(",")]
    base, new = results[0], results[-1]
    print(f"\n{'':18s} {'min ' + str(base['min_token_bucket']):>10s} {'min ' + str(new['min_token_bucket']):>10s}  ratio")
    for key in base["tok_s"]:
        print(f"{key:18s} {base['tok_s'][key]:10.1f} {new['tok_s'][key]:10.1f}  {new['tok_s'][key] / base['tok_s'][key]:.2f}x")
    print(f"{'start-up (s)':18s} {base['startup_s']:10.1f} {new['startup_s']:10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
