"""Issue 22: two jaxserve replicas behind the real routers a fleet uses, with no glue.

vLLM's router (vllm-router 0.1.17; round_robin, then cache_aware) and SGLang's gateway
(sglang-router 0.3.2) each front two tiny-model replicas; through each: a completion, a streamed
chat and the `openai` client, with the client's X-Request-Id coming back. round_robin must reach
both replicas, cache_aware must keep one prompt on one replica, and SGLang's gateway must register
the workers under the served model name (it reads /server_info and /model_info), not `unknown`.
`make routers` builds the venvs (under $JAXSERVE_CLIENT_VENVS, as the real clients'); a router
that is missing or cannot start fails the test, it is not skipped.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from server_utils import exercise_through_router, free_port, request, router_bin, start_server

ROOT = Path(__file__).parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def replicas(tiny_model, xla_cache):
    servers = [start_server(tiny_model, xla_cache) for _ in range(2)]
    yield servers
    for s in servers:
        s["proc"].kill()
        s["proc"].wait()


def log_tail(path: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", path.read_text())[-3000:]  # the routers colour their logs


def start_router(cmd: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start a router on a free port; ready once its /v1/models lists our model."""
    port = free_port()
    log = open(log_path, "w")
    # Each router on its own metrics port too: the default (29000) may be held by another router.
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())],
                            stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    listed = "nothing"
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{cmd[0]} exited with {proc.returncode}: {log_tail(log_path)}")
        try:
            status, _, raw = request("GET", base + "/v1/models", timeout=2)
            listed = raw.decode(errors="replace")
            if status == 200 and "tiny" in {m.get("id") for m in json.loads(raw).get("data", [])}:
                return proc, base
        except (OSError, ValueError):
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"{cmd[0]} never listed the model 'tiny' at /v1/models (it listed {listed}): "
                        f"{log_tail(log_path)}")
        time.sleep(0.5)


def finished(server: dict) -> float:
    """Requests this replica finished, from its vllm: metrics."""
    _, _, raw = request("GET", server["base"] + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_vllm_router_round_robin_and_cache_aware(replicas, tmp_path):
    workers = [s["base"] for s in replicas]
    exe = str(router_bin(".venv-vllm-router", "vllm-router"))

    proc, base = start_router([exe, "--worker-urls", *workers, "--policy", "round_robin"], tmp_path / "rr.log")
    try:
        before = [finished(s) for s in replicas]
        exercise_through_router(base)
        moved = [finished(s) - b for s, b in zip(replicas, before)]
        assert all(m > 0 for m in moved), f"round_robin left a replica idle: {moved}"
    finally:
        proc.kill()
        proc.wait()

    proc, base = start_router([exe, "--worker-urls", *workers, "--policy", "cache_aware"], tmp_path / "ca.log")
    try:
        exercise_through_router(base)
        before = [finished(s) for s in replicas]
        prompt = "A prompt the cache-aware policy should keep on one replica. " * 4
        for _ in range(3):
            status, _, raw = request("POST", base + "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                                          "max_tokens": 2})
            assert status == 200, raw
        moved = sorted(finished(s) - b for s, b in zip(replicas, before))
        assert moved == [0, 3], f"cache_aware spread one prompt over the replicas: {moved}"
    finally:
        proc.kill()
        proc.wait()


def test_sglang_router_registers_the_model_name(replicas, tmp_path):
    python = str(router_bin(".venv-sglang-router", "python"))
    log = tmp_path / "sglang.log"
    proc, base = start_router([python, "-m", "sglang_router.launch_router", "--worker-urls",
                               *[s["base"] for s in replicas], "--policy", "round_robin"], log)
    try:
        status, _, raw = request("GET", base + "/v1/models")
        assert [m["id"] for m in json.loads(raw)["data"]] == ["tiny"]  # not "unknown": read from /server_info
        before = [finished(s) for s in replicas]
        exercise_through_router(base)
        moved = [finished(s) - b for s, b in zip(replicas, before)]
        assert all(m > 0 for m in moved), f"round_robin left a replica idle: {moved}"
        for s in replicas:  # what the gateway asked each worker for at registration
            text = s["log"].read_text()
            assert '"GET /server_info" 200' in text and '"GET /model_info" 200' in text
    finally:
        proc.kill()
        proc.wait()
