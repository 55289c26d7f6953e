"""Prefix caching (RadixAttention): cache on against off, in the same run, on three workloads.

    python scripts/bench_prefix.py --groups 8 --per-group 8 --system-len 500 --out docs/results/bench_prefix.json

- shared system prompt: groups x per-group questions, each group with its own system prompt;
- multi-turn chat: conversations whose every turn resends the whole history;
- no shared prefix: random prompts, to show what the cache costs when it cannot help.
All requests arrive at once; greedy, EOS ignored. Reports output throughput, mean and p99 time to
first token, and the hit rate; checks that outputs are identical with the cache on and off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.engine import LLMEngine  # noqa: E402


def random_ids(rng, n: int, vocab: int = 40000) -> list[int]:
    return rng.integers(100, vocab, n).tolist()


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    start = time.monotonic()
    reqs = [engine.add_request(engine.new_request_id(), p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    seconds = time.perf_counter() - t0
    ttft = np.array([r.first_token_time - start for r in reqs])
    tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
    return dict(seconds=seconds, tok_per_s=tokens / seconds, ttft_mean=float(ttft.mean()),
                ttft_p99=float(np.percentile(ttft, 99)),
                cached_prompt_tokens=sum(o.num_cached_tokens for o in outs.values()),
                prompt_tokens=sum(len(p) for p in prompts),
                outputs=[outs[r.request_id].outputs[0].token_ids for r in reqs])


def unrelated_prompts(rng, count: int, length: int) -> list[list[int]]:
    return [random_ids(rng, length) for _ in range(count)]


def shared_prefix(rng, groups, per_group, system_len, question_len):
    return [s + random_ids(rng, question_len) for s in (random_ids(rng, system_len) for _ in range(groups))
            for _ in range(per_group)]


def run_chat(engine: LLMEngine, rng, conversations: int, turns: int, turn_len: int, output_len: int) -> dict:
    """Each turn: all conversations send their whole history plus a new user message."""
    histories = [random_ids(rng, turn_len) for _ in range(conversations)]
    total = dict(seconds=0.0, tokens=0, ttft=[], outputs=[], cached=0, prompt=0)
    for _ in range(turns):
        r = run_batch(engine, histories, output_len)
        total["seconds"] += r["seconds"]
        total["tokens"] += r["tok_per_s"] * r["seconds"]
        total["ttft"].append(r["ttft_mean"])
        total["outputs"] += r["outputs"]
        total["cached"] += r["cached_prompt_tokens"]
        total["prompt"] += r["prompt_tokens"]
        histories = [h + out + random_ids(rng, turn_len) for h, out in zip(histories, r["outputs"])]
    return dict(seconds=total["seconds"], tok_per_s=total["tokens"] / total["seconds"],
                ttft_mean=float(np.mean(total["ttft"])), ttft_p99=float("nan"),
                cached_prompt_tokens=total["cached"], prompt_tokens=total["prompt"], outputs=total["outputs"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=500)
    ap.add_argument("--question-len", type=int, default=30)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", type=lambda s: s.split(","),
                    default=["shared_system_prompt", "multi_turn_chat", "no_shared_prefix"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    results = {"args": vars(args)}
    for cache in (False, True):
        cfg = EngineConfig(enable_prefix_caching=cache, max_model_len=2048, max_num_seqs=64,
                           max_num_batched_tokens=512, kv_cache_memory=2.0)
        engine = LLMEngine(cfg, show_progress=False)
        run_batch(engine, [random_ids(np.random.default_rng(99), 20)], 2)  # warm
        label = "on" if cache else "off"
        work = {
            "shared_system_prompt": lambda: run_batch(engine, shared_prefix(np.random.default_rng(args.seed), args.groups,
                                                                             args.per_group, args.system_len,
                                                                             args.question_len), args.output_len),
            "multi_turn_chat": lambda: run_chat(engine, np.random.default_rng(args.seed + 1), args.conversations,
                                                args.turns, args.turn_len, args.output_len),
            "no_shared_prefix": lambda: run_batch(engine, unrelated_prompts(np.random.default_rng(args.seed + 2),
                                                                            args.groups * args.per_group, 400),
                                                  args.output_len),
        }
        for name, fn in work.items():
            if name not in args.workloads:
                continue
            for replica in engine.replicas:  # each workload starts cold
                if replica.prefix_cache is not None:
                    replica.prefix_cache.reset()
            results.setdefault(name, {})[label] = fn()
            r = results[name][label]
            print(f"{name:22s} cache {label:3s}: {r['tok_per_s']:7.1f} tok/s, TTFT mean {r['ttft_mean']:.2f} s "
                  f"p99 {r['ttft_p99']:.2f} s, cached {r['cached_prompt_tokens']}/{r['prompt_tokens']} prompt tokens",
                  flush=True)
        del engine
    print(f"\n{'workload':22s} {'tok/s off':>9s} {'tok/s on':>9s} {'speed-up':>8s} {'TTFT off':>9s} {'TTFT on':>8s} "
          f"{'hit rate':>8s} identical")
    for name in args.workloads:
        off, on = results[name]["off"], results[name]["on"]
        results[name]["speedup"] = on["tok_per_s"] / off["tok_per_s"]
        results[name]["hit_rate"] = on["cached_prompt_tokens"] / on["prompt_tokens"]
        results[name]["identical"] = off["outputs"] == on["outputs"]
        print(f"{name:22s} {off['tok_per_s']:9.1f} {on['tok_per_s']:9.1f} {results[name]['speedup']:7.2f}x "
              f"{off['ttft_mean']:8.2f}s {on['ttft_mean']:7.2f}s {results[name]['hit_rate']:8.1%} "
              f"{results[name]['identical']}")
        off.pop("outputs"), on.pop("outputs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
