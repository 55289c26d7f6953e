"""Starting a jaxserve server process in tests, and talking to it over HTTP (shared by the server test modules)."""

from __future__ import annotations

import http.client
import os
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

MAX_MODEL_LEN = 128
SERVER_ARGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", str(MAX_MODEL_LEN),
               "--num-pages", "96", "--max-waiting", "48", "--enable-debug-endpoints"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_full_vocab_tiny(root: Path, name: str = "tiny-full-vocab", seed: int = 0, **config) -> Path:
    """A 2-layer random Llama whose vocabulary is the default tokenizer's (49,152): real text works.
    `config` overrides the transformers LlamaConfig fields below."""
    import torch
    import transformers

    from jaxserve.loading import load_tokenizer

    tok = load_tokenizer(None)
    fields = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = transformers.LlamaConfig(**{**fields, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = root / name
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def xla_cache(fallback: Path) -> str:
    """The --compilation-cache-dir for a server the tests start: the run's shared cache (conftest)."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR", str(fallback))


def start_server(model: Path | None, cache: Path, *extra: str, http_port: int | None = None,
                 grpc_port: int | None = None, name: str = "tiny", base_args: Sequence[str] = SERVER_ARGS) -> dict:
    """A server on free ports (or the given ones: a restart in place); returns once /health is 200.
    `model` None: the embedded default model. `cache`: a directory for its log (and its XLA cache
    outside a test run)."""
    grpc_port, http_port = grpc_port or free_port(), http_port or free_port()
    cmd = [sys.executable, "-m", "jaxserve.serve", *(["--model", str(model)] if model is not None else []),
           "--served-model-name", name, "--grpc-port", str(grpc_port), "--http-port", str(http_port),
           "--compilation-cache-dir", xla_cache(cache), *base_args, *extra]
    log = open(cache / f"server-{http_port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited: " + Path(log.name).read_text()[-3000:])
        try:
            if request("GET", base + "/health", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("server did not become healthy: " + Path(log.name).read_text()[-3000:])
        time.sleep(0.5)
    return dict(proc=proc, base=base, grpc=f"127.0.0.1:{grpc_port}", http_port=http_port, log=Path(log.name))


def start_default_model_server(cache: Path) -> dict:
    """The default model (served as "smol") with room for a few chat turns: the openai-client suites."""
    return start_server(None, cache, "--enable-debug-endpoints", name="smol",
                        base_args=("--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "640",
                                   "--num-pages", "128"))


def request(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None,
            timeout: float = 120) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()  # headers: case-insensitive lookups
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def post(srv: dict, path: str, body: dict, **kw) -> tuple[int, dict]:
    status, _, raw = request("POST", srv["base"] + path, body, **kw)
    return status, json.loads(raw) if raw else {}


def sse(srv: dict, path: str, body: dict, timeout: float = 120) -> tuple[int, list]:
    """POST with stream: true; the parsed events ("[DONE]" kept as a string)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv["http_port"], timeout=timeout)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out = resp.status, [json.loads(resp.read())]
        conn.close()
        return out
    events = []
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return 200, events


def router_bin(venv: str, name: str) -> Path:
    """A router's executable from the venv `make routers` builds (under $JAXSERVE_CLIENT_VENVS,
    set by make); a missing one fails the test that needs it, never skips it."""
    import pytest

    path = Path(os.environ.get("JAXSERVE_CLIENT_VENVS", Path(__file__).resolve().parents[1])) / venv / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make routers` (the routers' venvs)")
    return path


def exercise_through_router(base: str) -> None:
    """A completion (with an X-Request-Id), a streamed chat and the openai client, through the router."""
    from openai import OpenAI

    status, headers, raw = request("POST", base + "/v1/completions",
                                   {"model": "tiny", "prompt": "Hello there", "max_tokens": 4},
                                   headers={"X-Request-Id": "via-router-1"})
    assert status == 200, raw
    body = json.loads(raw)
    assert body["model"] == "tiny" and body["usage"]["completion_tokens"] == 4
    assert headers["X-Request-Id"] == "via-router-1" and body["id"] == "cmpl-via-router-1"

    port = int(base.rsplit(":", 1)[1])
    status, events = sse({"http_port": port}, "/v1/chat/completions",
                         {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert status == 200 and events[-1] == "[DONE]", events
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3)
    assert out.model == "tiny" and out.usage.completion_tokens == 3
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3, stream=True)
    assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)


def start_vllm_router(args: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's router (from `make routers`) on free ports with `args`; returns once /health is 200."""
    port = free_port()
    cmd = [str(router_bin(".venv-vllm-router", "vllm-router")), "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port()), *args]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            if request("GET", base + "/health", timeout=2)[0] == 200:
                return proc, base
        except OSError:
            pass
        assert time.time() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.5)


def event_ports() -> int:
    """A free port whose successor is free too: KV events on it, their replay socket on the next."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def kv_events_json(port: int, **extra) -> str:
    """--kv-events-config publishing on `port`, replay on `port + 1`."""
    return json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                       "replay_endpoint": f"tcp://*:{port + 1}", **extra})
