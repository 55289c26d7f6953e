"""Speculative decoding through the server, in one run: the same load against jaxserve with
speculation off and with each --speculative-config given (issue 21's server-level figure).

    python scripts/bench_spec_server.py --out docs/results/bench_spec_server_cpu.json

The load is scripts/benchmark.py's `edit` workload (a code file in a completion prompt, then the
same file again: outputs repeat their input; greedy, ignore_eos, 256 output tokens, streamed
/v1/completions) at each --concurrency, plus its `random` workload (prompts of words, where drafts
rarely match) at the highest, to show what speculation costs where it does not pay. Prints output
tok/s and median time per output token per server, with each speculative server's speed-up over
speculation off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from bench_vs_vllm import MODEL_NAME, free_port, run_server  # noqa: E402

SPECS = ['{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
         '{"method": "suffix", "num_speculative_tokens": 8}']


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", default=None, help="a --speculative-config JSON (repeatable)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.gettempdir()) / "bench_spec_server.json"
    concurrency = [int(c) for c in args.concurrency.split(",")]
    points = [(f"edit c{c}", ["--workload", "edit", "--num-prompts", str(max(4, 2 * c)), "--max-concurrency", str(c),
                              "--output-len", str(args.output_len)]) for c in concurrency]
    points.append((f"random c{concurrency[-1]}", ["--workload", "random", "--num-prompts", str(4 * concurrency[-1]),
                                                   "--max-concurrency", str(concurrency[-1]),
                                                   "--output-len", str(args.output_len)]))
    runs = []
    for spec in [None, *(args.spec or SPECS)]:
        port = free_port()
        cmd = [sys.executable, "-m", "jaxserve.serve", "--served-model-name", MODEL_NAME, "--http-port", str(port),
               "--grpc-port", str(free_port()), *(["--speculative-config", spec] if spec else [])]
        label = "off" if spec is None else json.loads(spec)["method"]
        runs.append({**run_server(label, cmd, dict(os.environ), points, out), "speculative_config": spec})
    base = runs[0]
    print("\n| point | " + " | ".join(f"{r['label']} tok/s (TPOT ms)" for r in runs)
          + " | " + " | ".join(f"{r['label']} / off" for r in runs[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(runs) - 1))
    for i, (name, _) in enumerate(points):
        cells = [f"{r['points'][i]['output_throughput']:.1f} ({r['points'][i]['median_tpot_ms']:.1f})" for r in runs]
        cells += [f"{r['points'][i]['output_throughput'] / base['points'][i]['output_throughput']:.2f}x"
                  for r in runs[1:]]
        print(f"| {name} | " + " | ".join(cells) + " |")
    out.write_text(json.dumps({"runs": runs}, indent=2))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
