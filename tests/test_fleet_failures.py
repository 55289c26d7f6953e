"""Issue 22: replicas that die or leave behind vLLM's router.

- Under load through `vllm-router`, one replica is SIGKILLed and another SIGTERMed: the router's
  retries and our drain lose no request (non-streamed requests, which a router can retry).
- A replica SIGKILLed and restarted in place (same ports) behind `kv_aware`: its KV-event stream
  resyncs. The restarted replica first publishes AllBlocksCleared, so the router forgets what the
  dead one held, and the router follows the new stream (sequence numbers from 0 again).
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_utils import event_ports, kv_events_json, make_full_vocab_tiny, request, start_server, start_vllm_router

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def running(server: dict) -> float:
    _, _, raw = request("GET", server["base"] + "/metrics", timeout=10)
    return sum(float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
               if line.startswith("vllm:num_requests_running{"))


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_sigkill_and_sigterm_under_load_lose_no_request(tiny_model, xla_cache, tmp_path):
    servers = [start_server(tiny_model, xla_cache, "--grace-period", "120") for _ in range(3)]
    router, base = start_vllm_router(["--policy", "round_robin", "--worker-urls", *[s["base"] for s in servers],
                                 "--retry-max-retries", "6", "--retry-initial-backoff-ms", "100",
                                 "--health-check-interval-secs", "1"], tmp_path / "router.log")
    killed, drained, kept = servers
    results: list[tuple[int, bytes]] = []
    try:
        def one(i: int) -> None:
            status, _, raw = request("POST", base + "/v1/completions",
                                     {"model": "tiny", "prompt": f"request {i}: tell me a story", "max_tokens": 24,
                                      "ignore_eos": True, "temperature": 0}, timeout=300)
            results.append((status, raw))

        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(one, i) for i in range(72)]
            deadline = time.time() + 120
            while running(killed) < 2 or running(drained) < 2:  # both victims busy when hit
                assert time.time() < deadline, "the load never reached both victims"
                time.sleep(0.05)
            in_flight_on_killed = running(killed)
            killed["proc"].send_signal(signal.SIGKILL)
            drained["proc"].send_signal(signal.SIGTERM)
            for f in futures:
                f.result()
        assert drained["proc"].wait(180) == 0, drained["log"].read_text()[-3000:]
        failed = [(s, raw[:200]) for s, raw in results if s != 200]
        assert not failed, f"{len(failed)} of {len(results)} failed ({in_flight_on_killed:.0f} were on the " \
                           f"killed replica): {failed[:3]}"
        assert all(json.loads(raw)["usage"]["completion_tokens"] == 24 for _, raw in results)
        log = re.sub(r"\x1b\[[0-9;]*m", "", drained["log"].read_text())
        assert "503" in log  # the draining replica turned new requests away, and the router went elsewhere
    finally:
        stop_all([router] + [s["proc"] for s in servers])


def test_restarted_replica_resyncs_its_kv_events(tmp_path_factory, monkeypatch):
    """Two servers behind kv_aware. A holds prompts P when it is SIGKILLed and restarted on the same
    ports; then A caches new prompts Q. Through the router each Q must reach A (the router reads A's
    new stream; by chance 1 time in 8), and the router must credit nobody with P's blocks (the
    restarted A said it holds nothing), as its debug log shows."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # one block hash on both servers and across the restart
    model = make_full_vocab_tiny(tmp_path_factory.mktemp("restart"))
    xla = tmp_path_factory.mktemp("restartxla")
    ports = [event_ports(), event_ports()]
    servers = [start_server(model, xla, "--kv-events-config", kv_events_json(p)) for p in ports]
    args = ["--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", "tiny", "--log-level", "debug",
            "--health-check-interval-secs", "1", "--worker-urls", *[s["base"] for s in servers]]
    for s, p in zip(servers, ports):
        args += ["--kv-event-source", f"{s['base']}=tcp://127.0.0.1:{p}",
                 "--kv-event-replay-source", f"{s['base']}=tcp://127.0.0.1:{p + 1}"]
    log_path = xla / "router.log"
    router, base = start_vllm_router(args, log_path)
    rng = random.Random(5)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(40)]  # two full pages and a part

    def complete(url: str, ids: list[int]) -> int:
        status, _, body = request("POST", url + "/v1/completions",
                                  {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0})
        assert status == 200, body
        return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]

    def router_log() -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text())

    a, b = servers
    try:
        p = [prompt() for _ in range(3)]
        for ids in p:
            complete(a["base"], ids)
        time.sleep(2)
        assert [complete(base, ids + [7] * 3) for ids in p] == [32] * 3  # the router knows A holds them

        a["proc"].send_signal(signal.SIGKILL)
        a["proc"].wait()
        servers[0] = a = start_server(model, xla, "--kv-events-config", kv_events_json(ports[0]),
                                      http_port=a["http_port"], grpc_port=int(a["grpc"].rsplit(":", 1)[1]))
        q = [prompt() for _ in range(3)]
        for ids in q:
            assert complete(a["base"], ids) == 0
        time.sleep(3)  # the events reach the router, which has seen A healthy again
        assert [complete(base, ids + [9] * 3) for ids in q] == [32] * 3, "the router lost A's new stream"
        seen = len(router_log())
        assert [complete(base, ids + [8] * 3) for ids in p] == [0] * 3  # nobody holds P now
        credited = re.findall(r"KV prefix decision .*credited_prefix_tokens=(\d+)", router_log()[seen:])
        assert credited == ["0"] * 3, f"the router still credits the dead A with P's blocks: {credited}"
    finally:
        stop_all([router] + [s["proc"] for s in servers])
