#!/usr/bin/env python
"""Structured output's cost, in one run, on the default model (issue 19's two figures).

1. Throughput of a batch where half the requests carry a JSON schema, against the same batch
   unconstrained. Every request produces exactly --max-tokens tokens either way (unconstrained
   ones ignore EOS; the schema ends in a long string field, so max_tokens cuts constrained ones),
   so the two batches do the same model work and differ only by the grammar masks. Both engines:
   the default overlapped one and the synchronous one (constrained rows are planned only when no
   token of theirs is in flight, docs/structured_output.md). Median of --repeats runs.
2. Time to first token of one request with a new, large schema (its grammar compiled on arrival)
   against the same schema again (cached) and against no schema. Each "new" schema differs by
   its property names, so none is cached.

    python scripts/bench_structured.py --out docs/results/bench_structured_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

TOPICS = ["a lighthouse keeper", "a city library", "a mountain village", "an old sailing ship",
          "a bakery at dawn", "a desert observatory", "a river ferry", "a winter market"]

# A record with several kinds of field, ending in a long free-text string: the masks cover enums,
# numbers with bounds, an array and string states, and max_tokens ends the output inside `story`.
RECORD = {"type": "object", "additionalProperties": False,
          "required": ["title", "year", "mood", "tags", "story"],
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                         "mood": {"enum": ["calm", "tense", "joyful", "sad"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                         "story": {"type": "string", "minLength": 4000}}}


def large_schema(nonce: int, fields: int) -> dict:
    """A large schema (nested objects, enums, bounded numbers, arrays); `nonce` renames its properties."""
    props = {}
    for i in range(fields):
        name = f"f{nonce}_{i}"
        kind = i % 4
        if kind == 0:
            props[name] = {"type": "string", "maxLength": 32}
        elif kind == 1:
            props[name] = {"type": "integer", "minimum": 0, "maximum": 1000 + i}
        elif kind == 2:
            props[name] = {"enum": [f"v{nonce}_{i}_{j}" for j in range(6)]}
        else:
            props[name] = {"type": "object", "required": ["a", "b"],
                           "properties": {"a": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
                                          "b": {"type": "boolean"}}}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def prompts(tokenizer, n: int) -> list[str]:
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as a JSON record with a title, a year, "
                                     "a mood, a few tags and a long story."}],
        tokenize=False, add_generation_prompt=True) for i in range(n)]


def batch_rate(llm: LLM, ps: list[str], params: list[SamplingParams], repeats: int) -> tuple[float, int]:
    rates, tokens = [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(ps, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(tokens / (time.perf_counter() - t))
    return statistics.median(rates), tokens


def first_token_seconds(llm: LLM, prompt: str, params: SamplingParams) -> float:
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schema-fields", type=int, default=64, help="properties of the large schema")
    ap.add_argument("--ttft-repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results: dict = {"config": vars(args), "throughput": {}, "ttft": {}}
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(json=RECORD))
    for label, overlap in (("overlapped", True), ("synchronous", False)):
        llm = LLM(model=args.model, max_num_seqs=args.requests, max_model_len=1024, async_scheduling=overlap,
                  show_progress=False)
        ps = prompts(llm.get_tokenizer(), args.requests)
        half = [constrained if i % 2 else plain for i in range(len(ps))]
        batch_rate(llm, ps, half, 1)  # warm: the grammar compiled and cached, llguidance's tokenizer built
        base, base_tokens = batch_rate(llm, ps, [plain] * len(ps), args.repeats)
        mixed, mixed_tokens = batch_rate(llm, ps, half, args.repeats)
        ratio = mixed / base
        results["throughput"][label] = {"unconstrained_tok_s": base, "half_json_tok_s": mixed, "ratio": ratio,
                                        "tokens": [base_tokens, mixed_tokens]}
        print(f"{label:11s} engine, {args.requests} requests x {args.max_tokens} tokens: unconstrained "
              f"{base:6.1f} tok/s, half with a JSON schema {mixed:6.1f} tok/s ({ratio:.3f}x; tokens "
              f"{base_tokens} vs {mixed_tokens})", flush=True)
        if overlap:  # TTFT on the default engine
            prompt = ps[0]
            one = dict(max_tokens=1, temperature=0.0)
            first_token_seconds(llm, prompt, SamplingParams(**one))
            none = [first_token_seconds(llm, prompt, SamplingParams(**one)) for _ in range(args.ttft_repeats)]
            new, cached = [], []
            for k in range(args.ttft_repeats):
                so = StructuredOutputsParams(json=large_schema(k, args.schema_fields))
                new.append(first_token_seconds(llm, prompt, SamplingParams(**one, structured_outputs=so)))
                cached.append(first_token_seconds(llm, prompt, SamplingParams(**one, structured_outputs=so)))
            size = len(json.dumps(large_schema(0, args.schema_fields)))
            results["ttft"] = {"schema_chars": size, "no_schema_s": statistics.median(none),
                               "new_schema_s": statistics.median(new), "cached_schema_s": statistics.median(cached)}
            print(f"time to first token (one request, median of {args.ttft_repeats}): no schema "
                  f"{statistics.median(none) * 1e3:.0f} ms, new {args.schema_fields}-property schema ({size} chars) "
                  f"{statistics.median(new) * 1e3:.0f} ms, the same schema again {statistics.median(cached) * 1e3:.0f} ms",
                  flush=True)
        llm.engine.close()
        del llm
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
