"""Load generator against a running server, over gRPC (ours) or the OpenAI HTTP API (any server).

    python scripts/benchmark.py --backend openai --base-url http://127.0.0.1:8000 \\
        --workload random --num-prompts 64 --request-rate 1,2,4,inf --out results.json --plot curve.png

Workloads (seeded, so runs compare): random (input/output lengths in ranges), sharegpt (a synthetic
conversation-like length mix), shared-prefix (groups x prompts with a common system prompt, as
SGLang's generated-shared-prefix), multi-turn (each turn resends the history), edit (a code file
then a request to write it again: outputs repeat the prompt, where speculative decoding pays; the
file is scripts/bench_spec.py's). Arrivals: all at once
(--request-rate inf) or Poisson at a rate, optionally capped by --max-concurrency; comma lists
sweep (every rate with every concurrency). Prints vLLM-style metrics per point, goodput against
--slo-ttft/--slo-tpot, JSON, and a throughput-latency plot with one curve per --label.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

WORDS = ("the of and to in is was for on that with as by at from his her an which or are this city river music "
         "science history garden window winter summer story people market question answer").split()


@dataclass
class Req:
    prompt: str
    output_len: int
    conversation: int = -1  # multi-turn: which conversation, turns run in order


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_len: int = 0
    error: str = ""


def text_of(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def make_workload(args) -> list[Req]:
    rng = random.Random(args.seed)
    if args.workload == "random":
        return [Req(text_of(rng, rng.randint(args.input_len[0], args.input_len[1])),
                    rng.randint(args.output_len[0], args.output_len[1])) for _ in range(args.num_prompts)]
    if args.workload == "sharegpt":  # long-tailed lengths, like chat logs
        return [Req(text_of(rng, min(1500, int(rng.lognormvariate(4.0, 1.0)) + 4)),
                    min(800, int(rng.lognormvariate(4.5, 0.8)) + 4)) for _ in range(args.num_prompts)]
    if args.workload == "shared-prefix":
        systems = [text_of(rng, args.system_len) for _ in range(args.groups)]
        reqs = [Req(s + " Question: " + text_of(rng, args.question_len), args.output_len[1])
                for s in systems for _ in range(args.prompts_per_group)]
        rng.shuffle(reqs)
        return reqs
    if args.workload == "edit":
        from bench_spec import CODE

        return [Req(f"{CODE}\n\n# The same file again ({i}), unchanged:\n", args.output_len[1])
                for i in range(args.num_prompts)]
    if args.workload == "multi-turn":
        return [Req(text_of(rng, args.question_len), args.output_len[1], conversation=c)
                for c in range(args.num_prompts)]
    raise SystemExit(f"unknown workload {args.workload}")


def finished(reason: str | None) -> tuple[bool, str]:
    """A request counts as successful only if the stream ended with stop or length (not abort, not cut)."""
    return (True, "") if reason in ("stop", "length") else (False, f"stream ended with finish_reason {reason!r}")


async def call_openai(client, args, prompt: str, max_tokens: int) -> tuple[Result, str]:
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if args.top_p is not None:
        body["top_p"] = args.top_p
    res, text, start = Result(ok=False), [], time.perf_counter()
    last, finish = start, None
    try:
        async with client.stream("POST", args.base_url + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res, ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_len = chunk["usage"]["prompt_tokens"]
                for ch in chunk.get("choices", []):
                    finish = ch.get("finish_reason") or finish
                    if ch.get("text"):
                        now = time.perf_counter()
                        if not text:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        text.append(ch["text"])
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or len(text)  # a server that sends no usage: count chunks
        res.ok, res.error = finished(finish)
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        res.error = repr(exc)
    return res, "".join(text)


async def call_grpc(stub, args, prompt: str, max_tokens: int) -> tuple[Result, str]:
    import grpc

    from jaxserve.proto import jaxserve_pb2 as pb

    res, text, start = Result(ok=False), [], time.perf_counter()
    last, finish = start, None
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=args.temperature, ignore_eos=True)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    req = pb.GenerateRequest(text=prompt, sampling=sampling)
    try:
        async for msg in stub(req, timeout=600):
            now = time.perf_counter()
            if msg.token_ids:
                if res.output_tokens == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.output_tokens += len(msg.token_ids)
            text.append(msg.text)
            if msg.finish_reason:
                finish, res.prompt_len = msg.finish_reason, msg.usage.prompt_tokens
        res.latency = time.perf_counter() - start
        res.ok, res.error = finished(finish)
    except Exception as exc:  # noqa: BLE001
        res.error = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
    return res, "".join(text)


async def run_point(args, reqs: list[Req], rate: float, concurrency: int | None) -> dict:
    if args.backend == "openai":
        import httpx

        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1000))
        call = lambda p, n: call_openai(client, args, p, n)  # noqa: E731
    else:
        import grpc

        channel = grpc.aio.insecure_channel(args.grpc_target)
        from jaxserve.proto import jaxserve_pb2 as pb

        stub = channel.unary_stream("/jaxserve.v1.Generation/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
        call = lambda p, n: call_grpc(stub, args, p, n)  # noqa: E731
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = np.random.default_rng(args.seed)
    bar = tqdm(total=len(reqs) * (args.turns if args.workload == "multi-turn" else 1),
               desc=f"rate={rate} conc={concurrency}", leave=False)
    results: list[Result] = []

    async def one(r: Req):
        async def go(prompt):
            if sem:
                async with sem:
                    return await call(prompt, r.output_len)
            return await call(prompt, r.output_len)

        if r.conversation < 0:
            res, _ = await go(r.prompt)
            results.append(res)
            bar.update()
            return
        history = r.prompt
        turn_rng = random.Random(f"{args.seed}-turns-{r.conversation}")  # not the workload's own stream
        for turn in range(args.turns):
            res, answer = await go(history)
            results.append(res)
            bar.update()
            if not res.ok:  # the rest of this conversation would resend a broken history
                bar.update(args.turns - turn - 1)
                break
            history += answer + " User: " + text_of(turn_rng, args.question_len)

    start = time.perf_counter()
    tasks = []
    for i, r in enumerate(reqs):
        if i and math.isfinite(rate):  # Poisson arrivals: exponential gaps between requests
            await asyncio.sleep(rng.exponential(1.0 / rate))
        tasks.append(asyncio.ensure_future(one(r)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    if args.backend == "openai":
        await client.aclose()
    else:
        await channel.close()
    return summarize(results, duration, args, rate, concurrency)


def summarize(results: list[Result], duration: float, args, rate, concurrency) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = np.array([r.ttft for r in ok] or [np.nan]) * 1000
    e2e = np.array([r.latency for r in ok] or [np.nan]) * 1000
    tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1] or [np.nan]) * 1000
    itl = np.array([x for r in ok for x in r.itl] or [np.nan]) * 1000
    good = [r for r in ok if r.ttft * 1000 <= args.slo_ttft and
            (r.output_tokens <= 1 or (r.latency - r.ttft) / (r.output_tokens - 1) * 1000 <= args.slo_tpot)]

    def stats(name, a):
        return {f"mean_{name}_ms": float(np.nanmean(a)), f"median_{name}_ms": float(np.nanmedian(a)),
                f"p99_{name}_ms": float(np.nanpercentile(a, 99))}

    return {"label": args.label, "backend": args.backend, "workload": args.workload,
            "request_rate": rate, "max_concurrency": concurrency,
            "temperature": args.temperature, "top_p": args.top_p,
            "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            "duration_s": duration, "request_throughput": len(ok) / duration,
            "output_throughput": out_tokens / duration,
            "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
            "goodput_req_s": len(good) / duration,
            **stats("ttft", ttft), **stats("tpot", tpot), **stats("itl", itl), **stats("e2e", e2e)}


def print_point(p: dict) -> None:
    print(f"\n==== {p['label']} ({p['backend']}, {p['workload']}): request rate {p['request_rate']}, "
          f"max concurrency {p['max_concurrency']} ====")
    for k in ("successful_requests", "failed_requests", "duration_s", "request_throughput", "output_throughput",
              "total_token_throughput", "goodput_req_s", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
              "mean_e2e_ms", "median_e2e_ms", "p99_e2e_ms"):
        v = p[k]
        print(f"{k:28s} {v:12.2f}" if isinstance(v, float) else f"{k:28s} {v:12d}")
    if p["errors"]:
        print("errors:", p["errors"])


def plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(p["label"] for p in points):
        ps = [p for p in points if p["label"] == label]
        ax.plot([p["output_throughput"] for p in ps], [p["median_tpot_ms"] for p in ps], "o-", label=label)
        for p in ps:
            ax.annotate(f"{p['max_concurrency'] or p['request_rate']}", (p["output_throughput"], p["median_tpot_ms"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel("median time per output token (ms)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def int_range(s: str) -> list[int]:
    lo, _, hi = s.partition("-")
    return [int(lo), int(hi or lo)]


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["openai", "grpc"], default="openai")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--grpc-target", default="127.0.0.1:50051")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--workload", choices=["random", "sharegpt", "shared-prefix", "multi-turn", "edit"], default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int_range, default=[32, 256], help="words, as MIN-MAX or N")
    ap.add_argument("--output-len", type=int_range, default=[16, 128],
                    help="tokens, as MIN-MAX or N (shared-prefix, multi-turn: MAX; sharegpt: its own mix)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=400)
    ap.add_argument("--question-len", type=int, default=25)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--request-rate", type=floats, default=[math.inf], help="req/s, comma list; inf = all at once")
    ap.add_argument("--max-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--slo-ttft", type=float, default=2000.0, help="ms, for goodput")
    ap.add_argument("--slo-tpot", type=float, default=200.0, help="ms, for goodput")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (unseeded otherwise)")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--label", default="jaxserve")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file; points are appended to an existing one")
    ap.add_argument("--plot", default=None, help="PNG of throughput against latency over all points in --out")
    ap.add_argument("--plot-only", action="store_true", help="only draw --plot from the points in --out")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.out) as f:
            plot(json.load(f), args.plot)
        print(f"plot: {args.plot}")
        return
    reqs = make_workload(args)
    points = []
    sweep = [(r, c) for r in args.request_rate for c in (args.max_concurrency or [None])]
    for rate, conc in sweep:
        p = asyncio.run(run_point(args, reqs, rate, conc))
        print_point(p)
        points.append(p)
    if args.out:
        try:
            with open(args.out) as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = []
        with open(args.out, "w") as f:
            json.dump(old + points, f, indent=2)
        points = old + points
    if args.plot:
        plot(points, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
