#!/usr/bin/env python
"""Speculative decoding (n-gram drafts) against plain decoding, in one run, on the default model.

Three chat workloads: an edit (a code file in the prompt, the answer is the file with one
change: outputs repeat their input, where drafts are accepted), a summary of a given text, and
free chat. For each concurrency (that many requests at once, each workload's prompts varied), the
same requests run on an engine without speculation (the default: overlapped steps) and on one
with `--speculative-config`; the script prints output tok/s of each, the speed-up, and the mean
accepted length (tokens a verified sequence gained per step), and checks that greedy outputs
are identical. Median of --repeats runs.

    python scripts/bench_spec.py --out docs/results/bench_spec_cpu.json
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

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1

    def total(self) -> float:
        return self.price * self.quantity


def load_items(path: str) -> list[Item]:
    with open(path) as f:
        rows = json.load(f)
    return [Item(r["name"], float(r["price"]), int(r.get("quantity", 1))) for r in rows]


def cart_total(items: list[Item]) -> float:
    return sum(item.total() for item in items)


def cheapest(items: list[Item]) -> Item:
    return min(items, key=lambda item: item.price)


if __name__ == "__main__":
    items = load_items("cart.json")
    print(f"{len(items)} items, total {cart_total(items):.2f}")
    print("cheapest:", cheapest(items).name)
'''

TEXT = ("The river town of Aldmere grew up around a stone bridge built in the twelfth century. For "
        "generations its market drew farmers from the hills, who sold wool, cheese and apples to merchants "
        "travelling between the coast and the capital. When the railway arrived in 1861 the town changed "
        "quickly: a station, two mills and a brewery were built within a decade, and the population tripled. "
        "The mills closed in the 1950s, and for thirty years Aldmere declined, its young people leaving for "
        "the cities. Since the 1990s the town has recovered by turning its old buildings into workshops, "
        "galleries and small hotels, and the Saturday market, revived by a group of local growers, now "
        "attracts visitors from across the region. The council's plan for the next decade focuses on "
        "affordable housing and on restoring the riverbank paths that flooded in 2019.")

EDITS = ["rename the function `cheapest` to `lowest_priced`", "rename the class `Item` to `Product`",
         "change the file name cart.json to basket.json", "rename `cart_total` to `basket_total`"]
CHATS = ["Write a short story about a robot who learns to paint.", "Explain how a refrigerator works.",
         "Give me tips for learning a new language as an adult.", "Describe a walk through a forest in autumn.",
         "What are the pros and cons of working from home?", "Write a poem about the sea."]


def prompts(tokenizer, workload: str, n: int) -> list[str]:
    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    if workload == "edit":
        return [chat(f"Here is a Python file:\n\n{CODE}\nRewrite the whole file with one change: "
                     f"{EDITS[i % len(EDITS)]}. Output only the code.") for i in range(n)]
    if workload == "summary":
        return [chat(f"{TEXT}\n\nSummarize the text above in {2 + i % 3} sentences, reusing its wording.")
                for i in range(n)]
    return [chat(CHATS[i % len(CHATS)]) for i in range(n)]


def run(llm: LLM, workload: str, conc: int, args) -> tuple[float, list[list[int]], dict]:
    ps = prompts(llm.get_tokenizer(), workload, conc)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    return timed(llm, ps, params, args.repeats)


def timed(llm: LLM, ps: list[str], params: SamplingParams, repeats: int) -> tuple[float, list[list[int]], dict]:
    """(median output tok/s over `repeats` runs of the prompts, the last run's tokens, the
    speculative-decoding counts of all runs, with the mean accepted length)."""
    rates, outs = [], None
    before = llm.engine.spec_decode_stats
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(ps, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    after = llm.engine.spec_decode_stats
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    spec = {"drafts": drafts, "draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
            "accepted_tokens": accepted, "mean_accepted_length": 1 + accepted / drafts if drafts else None}
    return statistics.median(rates), [o.outputs[0].token_ids for o in outs], spec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    ap.add_argument("--workloads", default="edit,summary,chat")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engine default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    results: dict = {"config": vars(args), "runs": {}}
    tokens = {}
    for label, spec in (("off", None), ("on", args.speculative_config)):
        llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=1024, speculative_config=spec,
                  show_progress=False)
        for workload in workloads:
            for conc in concurrency:
                rate, toks, stats = run(llm, workload, conc, args)
                key = f"{workload} c{conc}"
                results["runs"].setdefault(key, {})[label] = {"tok_s": rate, **({"spec": stats} if spec else {})}
                tokens[(label, key)] = toks
                extra = f", mean accepted length {stats['mean_accepted_length'] or 0:.2f}" if spec else ""
                print(f"speculation {label:3s} {key:12s}: {rate:7.1f} tok/s{extra}", flush=True)
        llm.engine.close()
        del llm
    print(f"\n{'workload':14s} {'off tok/s':>10s} {'on tok/s':>10s} {'speed-up':>9s} {'accepted len':>13s}  outputs")
    for key, r in results["runs"].items():
        same = tokens[("off", key)] == tokens[("on", key)]
        r["speedup"] = r["on"]["tok_s"] / r["off"]["tok_s"]
        r["identical_outputs"] = same
        mal = r["on"]["spec"]["mean_accepted_length"]
        print(f"{key:14s} {r['off']['tok_s']:10.1f} {r['on']['tok_s']:10.1f} {r['speedup']:8.2f}x "
              f"{(mal or 0):13.2f}  {'identical' if same else 'DIFFER'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
