"""jaxserve against llama.cpp's llama-server on the same GGUF file, decode at concurrency 1 and 8, in one run (issue 18).

    flock /tmp/jaxserve-cpu.lock nice -n 19 .venv/bin/python scripts/bench_llama_cpp.py \\
        --out docs/results/bench_llama_cpp_f32.json
    flock /tmp/jaxserve-cpu.lock nice -n 19 .venv/bin/python scripts/bench_llama_cpp.py \\
        --jaxserve-args "--quantization int8" --out docs/results/bench_llama_cpp_int8.json
    flock /tmp/jaxserve-cpu.lock nice -n 19 .venv/bin/python scripts/bench_llama_cpp.py \\
        --jaxserve-args "--quantization gguf" --out docs/results/bench_llama_cpp_gguf.json

llama-server comes from scripts/install_llama_cpp.sh (once, minutes; CPU only, Release,
-DGGML_NATIVE=ON, no CURL, from the llama.cpp tree vendored in the PyPI sdist of
llama-cpp-python 0.3.36, since GitHub is out of reach here):

    bash scripts/install_llama_cpp.sh      # -> ~/.cache/jaxserve/llama-cpp/build/bin/llama-server

Both serve the shipped Q4_1 GGUF (default: jaxserve.loading.default_model_path()): llama.cpp
computes on the Q4_1 blocks themselves; jaxserve dequantizes them to float32 (its default),
requantizes to its own int8 (`--jaxserve-args "--quantization int8"`) or computes on the same
blocks (`--jaxserve-args "--quantization gguf"`). One server runs at a time:
jaxserve once (`python -m jaxserve.serve --model GGUF` plus --jaxserve-args) for both
concurrencies, llama.cpp twice (`llama-server -m GGUF -t 2 -tb 2 --parallel P -c P*slot_ctx`, P=1
for concurrency 1 and P=8 for concurrency 8). Every server gets the same client
(scripts/benchmark.py's streamed OpenAI /v1/completions call, the body jaxserve and llama.cpp both
take: greedy, `ignore_eos`, `stream_options.include_usage`), first a warm-up of P streams, then 3
measurements of P streams started together: each stream a distinct ~20-token prompt (the same
prompts on every server) and 128 output tokens. Per measurement: output tok/s (all streams'
tokens / wall time from the first send to the last token), median per-stream decode tok/s
((tokens - 1) / (end - first token)), median TTFT; reported: the median over the measurements.
Prints a table with jaxserve / llama.cpp and writes JSON (--out), including how far the greedy
texts agree (they need not: the two compute the same weights with different arithmetic).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_vs_vllm import MODEL_NAME, free_port, server_command, wait_healthy  # noqa: E402
from benchmark import call_openai, text_of  # noqa: E402

LLAMA_SERVER = Path("~/.cache/jaxserve/llama-cpp/build/bin/llama-server").expanduser()
CONCURRENCIES = (1, 8)


def make_prompts(n: int, seed: int, words: int) -> list[str]:
    """n distinct prompts of about 20 tokens (16 words of benchmark.py's vocabulary after 'Story k:')."""
    rng = random.Random(seed)
    return [f"Story {k}: " + text_of(rng, words) for k in range(n)]


async def streams(base: str, prompts: list[str], max_tokens: int) -> tuple[float, list, list[str]]:
    """All prompts sent at once, one stream each; (wall seconds, results, texts)."""
    import httpx

    args = SimpleNamespace(model=MODEL_NAME, temperature=0.0, top_p=None, base_url=base)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(call_openai(client, args, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
    results, texts = [r for r, _ in out], [t for _, t in out]
    bad = [r.error or f"{r.output_tokens} tokens" for r in results if not r.ok or r.output_tokens != max_tokens]
    if bad:
        raise RuntimeError(f"{base}: {len(bad)} of {len(prompts)} streams failed or came back short: {bad[:3]}")
    return wall, results, texts


def measure(base: str, concurrency: int, prompts: dict, args) -> dict:
    """Warm-up of `concurrency` streams, then args.repeats measurements of `concurrency` streams."""
    asyncio.run(streams(base, prompts["warmup"][:concurrency], args.warmup_tokens))
    reps, texts = [], {}
    for r in range(args.repeats):
        batch = prompts[concurrency][r]
        wall, results, outs = asyncio.run(streams(base, batch, args.output_tokens))
        texts.update(zip(batch, outs))
        decode = [(x.output_tokens - 1) / (x.latency - x.ttft) for x in results]
        reps.append(dict(wall_s=wall, output_tokens=sum(x.output_tokens for x in results),
                         output_tok_per_s=sum(x.output_tokens for x in results) / wall,
                         median_stream_decode_tok_per_s=statistics.median(decode),
                         median_ttft_ms=1000 * statistics.median(x.ttft for x in results),
                         stream_decode_tok_per_s=decode, ttft_ms=[1000 * x.ttft for x in results],
                         prompt_tokens=[x.prompt_len for x in results]))
        print(f"  c{concurrency} #{r + 1}: {reps[-1]['output_tok_per_s']:.1f} tok/s, stream decode "
              f"{reps[-1]['median_stream_decode_tok_per_s']:.1f} tok/s, TTFT {reps[-1]['median_ttft_ms']:.0f} ms",
              flush=True)
    keys = ("output_tok_per_s", "median_stream_decode_tok_per_s", "median_ttft_ms")
    return {"concurrency": concurrency, **{k: statistics.median(x[k] for x in reps) for k in keys},
            "repeats": reps, "texts": texts}


def serve(label: str, cmd: list[str], env: dict, port: int, concurrencies, prompts, args) -> dict:
    """Start one server, measure it at the given concurrencies, stop it."""
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"bench_llama_cpp_{label.replace(' ', '_')}_{port}.log"
    print(f"\n== {label}: {shlex.join(cmd)}  (log {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        startup = wait_healthy(proc, base, log)
        print(f"{label}: up in {startup:.0f} s", flush=True)
        return {"label": label, "command": cmd, "startup_s": startup,
                **{f"c{c}": measure(base, c, prompts, args) for c in concurrencies}}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def agreement(a: dict, b: dict) -> dict:
    """Of the prompts both answered: identical texts, and the mean share of characters before the first difference."""
    common = [p for p in a if p in b]
    same = sum(a[p] == b[p] for p in common)
    shares = []
    for p in common:
        x, y = a[p], b[p]
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        shares.append(n / max(len(x), len(y), 1))
    return {"prompts": len(common), "identical": same, "mean_share_before_first_difference":
            statistics.fmean(shares) if shares else None}


def llama_version(binary: Path) -> str:
    r = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return " ".join((r.stdout + r.stderr).split())


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: jaxserve's shipped Q4_1 GGUF)")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp -t and -tb")
    ap.add_argument("--slot-ctx", type=int, default=512,
                    help="llama.cpp context per parallel slot (-c is P times this)")
    ap.add_argument("--jaxserve-args", default="", help="extra jaxserve.serve flags, e.g. '--quantization int8'")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=16, help="words after 'Story k:' (16: about 20 tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["both", "jaxserve", "llama.cpp"], default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from jaxserve.loading import default_model_path

        args.model = str(default_model_path())
    if args.only != "jaxserve" and not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server} missing: run `bash scripts/install_llama_cpp.sh` first")

    # Distinct prompts everywhere (no prefix reuse within or across measurements), the same on every server.
    pool = iter(make_prompts(max(CONCURRENCIES) + args.repeats * sum(CONCURRENCIES), args.seed, args.prompt_words))
    prompts: dict = {"warmup": [next(pool) for _ in range(max(CONCURRENCIES))]}
    for c in CONCURRENCIES:
        prompts[c] = [[next(pool) for _ in range(c)] for _ in range(args.repeats)]

    t_start = time.time()
    runs = {}
    if args.only in ("both", "jaxserve"):
        port = free_port()
        cmd, env = server_command("jaxserve", port, args, f"--model {args.model} {args.jaxserve_args}")
        runs["jaxserve"] = serve(f"jaxserve {args.jaxserve_args}".strip(), cmd, env, port, CONCURRENCIES, prompts, args)
    if args.only in ("both", "llama.cpp"):
        version = llama_version(args.llama_server)
        parts = {}
        for c in CONCURRENCIES:
            port = free_port()
            cmd = [str(args.llama_server), "-m", args.model, "-t", str(args.threads), "-tb", str(args.threads),
                   "--parallel", str(c), "-c", str(c * args.slot_ctx), "--alias", MODEL_NAME,
                   "--host", "127.0.0.1", "--port", str(port)]
            parts[c] = serve(f"llama.cpp --parallel {c}", cmd, dict(os.environ), port, (c,), prompts, args)
        runs["llama.cpp"] = {"label": "llama.cpp", "version": version,
                             **{f"c{c}": {"command": parts[c]["command"], "startup_s": parts[c]["startup_s"],
                                          **parts[c][f"c{c}"]} for c in CONCURRENCIES}}

    ratios = {}
    if len(runs) == 2:
        j, l = runs["jaxserve"], runs["llama.cpp"]
        for c in CONCURRENCIES:
            ratios[f"c{c}"] = {k: j[f"c{c}"][k] / l[f"c{c}"][k] for k in
                               ("output_tok_per_s", "median_stream_decode_tok_per_s", "median_ttft_ms")}
            ratios[f"c{c}"]["greedy_text_agreement"] = agreement(j[f"c{c}"]["texts"], l[f"c{c}"]["texts"])

    machine = f"{platform.machine()}, {os.cpu_count()} cpus, {cpu_model()}"
    print(f"\n{Path(args.model).name}, {machine}; {args.output_tokens} output tokens a stream, greedy, EOS ignored, "
          f"~20-token prompts; medians of {args.repeats}")
    names = list(runs)
    print("| concurrency | metric | " + " | ".join(runs[n]["label"] for n in names)
          + (" | jaxserve / llama.cpp |" if ratios else " |"))
    print("|---|---|" + "---:|" * (len(names) + bool(ratios)))
    for c in CONCURRENCIES:
        for k, name, fmt in (("output_tok_per_s", "output tok/s (aggregate)", "{:.1f}"),
                             ("median_stream_decode_tok_per_s", "per-stream decode tok/s (median)", "{:.1f}"),
                             ("median_ttft_ms", "TTFT ms (median)", "{:.0f}")):
            cells = [fmt.format(runs[n][f"c{c}"][k]) for n in names]
            if ratios:
                cells.append(f"{ratios[f'c{c}'][k]:.2f}x")
            print(f"| {c} | {name} | " + " | ".join(cells) + " |")
    for c, r in ratios.items():
        a = r["greedy_text_agreement"]
        print(f"{c}: greedy texts identical for {a['identical']}/{a['prompts']} prompts, "
              f"{100 * a['mean_share_before_first_difference']:.0f}% of characters before the first difference")
    print(f"total {time.time() - t_start:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine, "jaxserve_commit": commit,
            "model": args.model, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "ratios_jaxserve_over_llama_cpp": ratios, "runs": runs}, indent=2))
        print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
