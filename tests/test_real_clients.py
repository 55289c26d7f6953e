"""Real clients against a real server, each from its own venv (they pin their own torch, pydantic, ...):
lm-eval's `local-completions` must score a multiple-choice task as lm-eval's own HF backend does on the
same model, and guidellm's default chat benchmark must see no errored request. `make clients` makes
the venvs (.venv-lmeval, .venv-guidellm); .ci/run does that before the tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DATA = Path(__file__).parent / "data" / "mc_tiny.jsonl"
MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 0.05  # nats, per choice; f32 on both sides from the same dequantized GGUF

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def client_bin(venv: str, name: str) -> Path:
    path = Path(os.environ.get("JAXSERVE_CLIENT_VENVS", ROOT)) / venv / "bin" / name  # set by make
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make clients` (the real clients' venvs)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_env(tmp: Path) -> dict[str, str]:
    """The clients' env: offline, no project venv on PATH, their caches under tmp."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(tmp / "hf"), "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer as an HF directory, which both clients load by path."""
    from jaxserve.loading import load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(None).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Our own server for this module (no other module's tests share it, so killing it is safe)."""
    port, grpc_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.serve", "--http-port", str(port), "--grpc-port", str(grpc_port),
         "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "512", "--num-pages", "256"],
        stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            assert proc.poll() is None, "server exited:\n" + log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "server not healthy in 600 s:\n" + log_path.read_text()[-4000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        yield dict(base=base, log=log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def run_client(cmd: list[str | Path], env: dict, timeout: float, label: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout)
    print(f"{label}: {time.monotonic() - t0:.0f} s")
    assert done.returncode == 0, f"{label} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


# ---- lm-eval ---------------------------------------------------------------------------------------

TASK = """task: jaxserve_mc_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def lm_eval_logliks(out_dir: Path) -> dict[tuple[int, int], float]:
    """(doc_id, choice) -> log-likelihood, from lm-eval's --log_samples file."""
    files = sorted(out_dir.rglob("samples_jaxserve_mc_tiny_*.jsonl"))
    assert files, f"no samples file under {out_dir}"
    result = {}
    for line in files[-1].read_text().splitlines():
        sample = json.loads(line)
        for i, resp in enumerate(sample["filtered_resps"]):
            result[(sample["doc_id"], i)] = float(resp[0])
    return result


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lmeval_task")
    (path / "jaxserve_mc_tiny.yaml").write_text(TASK.format(data=DATA.resolve()))
    return path


@pytest.fixture(scope="module")
def hf_reference(task_dir, tokenizer_dir, tmp_path_factory) -> dict[tuple[int, int], float]:
    """lm-eval's own `--model hf` backend on the default GGUF (transformers dequantizes it)."""
    from jaxserve.loading import default_model_path

    lm_eval = client_bin(".venv-lmeval", "lm_eval")
    gguf = default_model_path()
    out = tmp_path_factory.mktemp("lmeval_hf")
    run_client([lm_eval, "run", "--model", "hf", "--model_args",
                f"pretrained={gguf.parent},gguf_file={gguf.name},tokenizer={tokenizer_dir},dtype=float32",
                "--device", "cpu", "--batch_size", "1", "--tasks", "jaxserve_mc_tiny", "--include_path", task_dir,
                "--output_path", out, "--log_samples"], offline_env(out), 1800, "lm-eval hf")
    return lm_eval_logliks(out)


def test_lm_eval_local_completions_matches_hf(server, task_dir, tokenizer_dir, hf_reference, tmp_path):
    """echo + logprobs: every choice's log-likelihood within 0.05 nats of lm-eval's HF backend."""
    lm_eval = client_bin(".venv-lmeval", "lm_eval")
    run_client([lm_eval, "run", "--model", "local-completions", "--model_args",
                f"model={MODEL},base_url={server['base']}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tokenizer_dir},num_concurrent=4,max_retries=1,max_length=512",
                "--tasks", "jaxserve_mc_tiny", "--include_path", task_dir, "--output_path", tmp_path,
                "--log_samples"], offline_env(tmp_path), 1800, "lm-eval local-completions")
    ours = lm_eval_logliks(tmp_path)
    assert set(ours) == set(hf_reference) and len(ours) == sum(
        len(json.loads(line)["choices"]) for line in DATA.read_text().splitlines())
    assert any(v < -1.0 for v in hf_reference.values())  # a reference of zeros would prove nothing
    worst = max(abs(ours[k] - hf_reference[k]) for k in ours)
    print(f"lm-eval: {len(ours)} choices, worst |ours - hf| = {worst:.4f} nats")
    bad = {k: (ours[k], hf_reference[k]) for k in ours if abs(ours[k] - hf_reference[k]) > TOLERANCE}
    assert not bad, f"(doc, choice): (ours, hf) beyond {TOLERANCE} nats: {bad}"


# ---- guidellm --------------------------------------------------------------------------------------

def test_guidellm_default_chat_benchmark_has_no_errors(server, tokenizer_dir, tmp_path):
    """guidellm's default request format is chat completions (content as a list of text parts)."""
    guidellm = client_bin(".venv-guidellm", "guidellm")
    report = tmp_path / "benchmarks.json"
    requests = 16
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": server["base"], "model": MODEL},
        "profile": {"kind": "concurrent", "streams": [4]},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 32, "output_tokens": 16}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
        "constraints": [{"kind": "max_requests", "count": requests}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    run_client([guidellm, "run", "--scenario", tmp_path / "scenario.json", "--disable-progress"],
               offline_env(tmp_path), 1200, "guidellm")
    data = json.loads(report.read_text())
    totals = guidellm_request_totals(data)
    print(f"guidellm: {totals}")
    assert totals["errored"] == 0 and totals["successful"] >= requests, (
        totals, error_texts(data)[:3], server["log"].read_text()[-3000:])


def error_texts(node: object) -> list[str]:
    """Every non-empty `error` string in a guidellm report (what the failed requests saw)."""
    if isinstance(node, dict):
        own = [str(v) for k, v in node.items() if k in ("error", "error_message") and v]
        return own + [e for v in node.values() for e in error_texts(v)]
    if isinstance(node, list):
        return [e for v in node for e in error_texts(v)]
    return []


def guidellm_request_totals(report: dict) -> dict[str, int]:
    """successful / errored / incomplete request counts of the report's one benchmark."""
    (bench,) = report["benchmarks"]
    found: dict[str, int] = {}

    def walk(node: object) -> None:  # the totals' place has moved between guidellm releases
        if isinstance(node, dict):
            if {"successful", "errored"} <= set(node) and all(isinstance(node[k], int) for k in ("successful", "errored")):
                found.setdefault("successful", node["successful"])
                found.setdefault("errored", node["errored"])
                found.setdefault("incomplete", node.get("incomplete", 0))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(bench)
    assert found, f"no request totals in the report: {list(bench)}"
    return found
