#!/usr/bin/env python
"""jaxserve replicas behind vLLM's router, on a multi-turn shared-prefix workload.

Each conversation re-sends its whole history every turn (a first prompt of --first-len random
tokens, then per turn an answer and a new question), conversations run side by side up to
--concurrency requests in flight. For every replica count and routing policy the script reports
the prefix-cache hit rate (cached prompt tokens / prompt tokens, from each response's usage),
TTFT p50/p99 and request throughput, beside two references measured in the same run: one replica
called directly (the best hit rate there is) and the same replica behind the router. The
router's overhead is TTFT through it against direct, at each --overhead-concurrency. A small
random Llama (token-id prompts) keeps the model's cost small, so what shows is routing and
caching. Each point gets fresh conversations, so caches warmed by an earlier point never help a
later one.

    python scripts/bench_fleet.py --replicas 2,4 --policies round_robin,cache_aware,kv_aware \
        --out docs/results/bench_fleet_cpu.json --plot docs/results/bench_fleet_cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from device_check import write_tiny_checkpoint  # noqa: E402  (numpy-only random checkpoint)

VOCAB = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy:\n{log.read_text()[-2000:]}")


def start_replica(model: Path, work: Path, args) -> dict:
    http, events_port, replay_port = free_port(), free_port(), free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
              "replay_endpoint": f"tcp://*:{replay_port}"}
    log = work / f"replica-{http}.log"
    cmd = [sys.executable, "-m", "jaxserve.serve", "--model", str(model), "--served-model-name", "tiny",
           "--http-port", str(http), "--grpc-port", str(free_port()), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--num-pages", str(args.num_pages),
           "--compilation-cache-dir", str(work / "xla"), "--kv-events-config", json.dumps(events)]
    env = dict(os.environ, PYTHONHASHSEED="0")  # the same block hashes on every replica
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    return dict(proc=proc, url=f"http://127.0.0.1:{http}", events=events_port, replay=replay_port, log=log)


def start_router(router: str, replicas: list[dict], policy: str, work: Path, log_level: str) -> dict:
    port = free_port()
    log = work / f"router-{policy}-{port}.log"
    cmd = [router, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
           "--policy", policy, "--log-level", log_level, "--worker-urls", *[r["url"] for r in replicas]]
    if policy == "kv_aware":
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", "tiny"]
        for r in replicas:
            cmd += ["--kv-event-source", f"{r['url']}=tcp://127.0.0.1:{r['events']}",
                    "--kv-event-replay-source", f"{r['url']}=tcp://127.0.0.1:{r['replay']}"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return dict(proc=proc, url=f"http://127.0.0.1:{port}", log=log)


async def run_workload(url: str, seed: int, args, concurrency: int) -> dict:
    """All conversations; per request (ttft s, prompt tokens, cached tokens)."""
    import httpx

    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    records: list[tuple[float, int, int]] = []
    errors: list[str] = []

    async def turn(client, history: list[int]) -> None:
        body = {"model": "tiny", "prompt": history, "max_tokens": args.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with sem:
            t0 = time.perf_counter()
            ttft, usage = None, None
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    errors.append(f"{resp.status_code} {(await resp.aread())[:200]!r}")
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if ttft is None and event.get("choices"):
                        ttft = time.perf_counter() - t0
                    usage = event.get("usage") or usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        records.append((ttft, usage["prompt_tokens"], cached))

    async def conversation(client, c: int) -> None:
        history = [rng.randrange(3, VOCAB) for _ in range(args.first_len)]
        for t in range(args.turns):
            if t:
                await asyncio.sleep(args.think_ms / 1e3)  # the user reads and types
            await turn(client, list(history))
            history += [rng.randrange(3, VOCAB) for _ in range(args.output_len + args.question_len)]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as client:
        await asyncio.gather(*(conversation(client, c) for c in range(args.conversations)))
    duration = time.perf_counter() - start
    ttft = np.array([r[0] for r in records]) * 1e3
    return dict(requests=len(records), errors=errors[:3], failed=len(errors),
                hit_rate=sum(r[2] for r in records) / max(1, sum(r[1] for r in records)),
                ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p99_ms=float(np.percentile(ttft, 99)),
                req_per_s=len(records) / duration, duration_s=duration)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--policies", default="round_robin,cache_aware,kv_aware")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-len", type=int, default=384)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--think-ms", type=float, default=0.0, help="pause between a conversation's turns")
    ap.add_argument("--overhead-concurrency", default="1,32", help="direct vs through the router, one replica")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=4096, help="per replica; past it the caches evict")
    ap.add_argument("--router", default=str(Path(os.environ.get("JAXSERVE_CLIENT_VENVS", ROOT))
                                            / ".venv-vllm-router" / "bin" / "vllm-router"))
    ap.add_argument("--router-log-level", default="info", help="debug shows each routing decision (slower)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    if not Path(args.router).exists():
        raise SystemExit(f"{args.router} is missing: run `make routers`")
    counts = [int(x) for x in args.replicas.split(",")]
    policies = args.policies.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench_fleet_"))
    print(f"logs in {work}", flush=True)
    model = write_tiny_checkpoint(work / "model", vocab=VOCAB, hidden=args.hidden, layers=args.layers, heads=4,
                                  kv_heads=2, head_dim=args.hidden // 4, max_positions=args.max_model_len)
    longest = args.first_len + (args.turns - 1) * (args.output_len + args.question_len) + args.output_len
    if longest > args.max_model_len:
        raise SystemExit(f"conversations reach {longest} tokens: raise --max-model-len")
    replicas = [start_replica(model, work, args) for _ in range(max(counts))]
    results = []
    procs = [r["proc"] for r in replicas]
    try:
        for r in replicas:
            wait_healthy(r["url"], r["proc"], r["log"])
        seed = 0

        def point(label: str, n: int, url: str, concurrency: int) -> None:
            nonlocal seed
            seed += 1
            p = asyncio.run(run_workload(url, seed, args, concurrency))
            p.update(label=label, replicas=n, concurrency=concurrency)
            results.append(p)
            if p["failed"]:
                raise SystemExit(f"{label}: {p['failed']} requests failed, e.g. {p['errors']}")
            print(f"{label:24s} replicas={n} conc={concurrency:<3d} hit rate {p['hit_rate']:6.1%}  "
                  f"TTFT p50 {p['ttft_p50_ms']:7.1f} ms  p99 {p['ttft_p99_ms']:7.1f} ms  "
                  f"{p['req_per_s']:6.2f} req/s  failed {p['failed']}", flush=True)

        def through_router(n: int, policy: str, concurrency: int) -> None:
            router = start_router(args.router, replicas[:n], policy, work, args.router_log_level)
            procs.append(router["proc"])
            try:
                wait_healthy(router["url"], router["proc"], router["log"], timeout=120)
                point(f"vllm-router {policy}", n, router["url"], concurrency)
            finally:
                router["proc"].kill()
                router["proc"].wait()

        for c in [int(x) for x in args.overhead_concurrency.split(",")]:
            point("direct", 1, replicas[0]["url"], c)
            through_router(1, "round_robin", c)
        if args.concurrency not in [int(x) for x in args.overhead_concurrency.split(",")]:
            point("direct", 1, replicas[0]["url"], args.concurrency)
        for n in counts:
            for policy in policies:
                through_router(n, policy, args.concurrency)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if args.out:
        args.out.write_text(json.dumps(dict(args={k: v for k, v in vars(args).items() if k not in ("out", "plot")},
                                            results=results), indent=2, default=str))
    if args.plot:
        plot(results, args, counts, policies)
    return 0


def plot(results: list[dict], args, counts: list[int], policies: list[str]) -> None:
    """Hit rate and TTFT p50 per policy and replica count, the one big replica as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = next(r for r in results if r["label"] == "direct" and r["concurrency"] == args.concurrency)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        rows = [next(r for r in results if r["label"] == f"vllm-router {policy}" and r["replicas"] == n
                     and r["concurrency"] == args.concurrency) for n in counts]
        xs = [j + i * width for j in range(len(counts))]
        axes[0].bar(xs, [100 * r["hit_rate"] for r in rows], width, label=policy)
        axes[1].bar(xs, [r["ttft_p50_ms"] for r in rows], width, label=policy)
    for ax, key, scale, name in ((axes[0], "hit_rate", 100, "prefix-cache hit rate (%)"),
                                 (axes[1], "ttft_p50_ms", 1, "TTFT p50 (ms)")):
        ax.axhline(scale * one[key], color="k", ls="--", lw=1, label="one replica, direct")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(counts))], [f"{n} replicas" for n in counts])
        ax.set_ylabel(name)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"vllm-router over jaxserve replicas: {args.conversations} conversations x {args.turns} turns, "
                 f"concurrency {args.concurrency}", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
