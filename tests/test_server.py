"""The server, as a real process over loopback: gRPC, OpenAI HTTP, metrics, bad input, cancellation.
(SIGTERM drains are tested in test_server_robust.py, on servers of their own.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server_utils import xla_cache

from jaxserve.client import Client
from jaxserve.proto import jaxserve_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metric(base: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    _, text = http("GET", base + "/metrics")
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    grpc_port, http_port = free_port(), free_port()
    cache = tmp_path_factory.mktemp("xla")
    cmd = [sys.executable, "-m", "jaxserve.serve", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
           "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "256", "--num-pages", "64",
           "--max-waiting", "64", "--compilation-cache-dir", xla_cache(cache), "--grace-period", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{http_port}"
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = health_pb2_grpc.HealthStub(channel)
    saw_not_serving = False
    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service="jaxserve.v1.Generation"), timeout=2).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            saw_not_serving = True
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not become healthy: " + proc.stdout.read())
    yield dict(proc=proc, base=base, grpc=f"127.0.0.1:{grpc_port}", health=stub, saw_not_serving=saw_not_serving)
    if proc.poll() is None:
        proc.kill()
    channel.close()


def test_health_goes_serving_after_warmup(server):
    assert server["saw_not_serving"]
    status, body = http("GET", server["base"] + "/health")
    assert status == 200


def test_grpc_streaming_and_usage(server):
    client = Client(server["grpc"])
    msgs = list(client.stream("The capital of France is", max_tokens=12, temperature=0.0))
    assert len(msgs) > 1 and msgs[-1].finish_reason in ("stop", "length")
    text = "".join(m.text for m in msgs)
    assert "Paris" in text
    usage = msgs[-1].usage
    assert usage.completion_tokens == sum(len(m.token_ids) for m in msgs) and usage.prompt_tokens > 0
    again, last = client.generate("The capital of France is", max_tokens=12, temperature=0.0)
    assert again == text
    ids, last = client.generate([504, 3575, 282, 4649, 314], max_tokens=4, temperature=0.0, logprobs=2)
    assert last.usage.prompt_tokens == 5 and last.finish_reason == "length"
    client.close()


def test_grpc_reflection_lists_the_service(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(server["grpc"])
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = [s.name for r in responses for s in r.list_services_response.service]
    assert "jaxserve.v1.Generation" in names and "grpc.health.v1.Health" in names
    channel.close()


def test_openai_client_both_endpoints(server):
    import openai

    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert c.choices[0].text and c.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.content and chat.choices[0].logprobs.content
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage = [], None
    for ch in stream:
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == chat.choices[0].message.content and usage.completion_tokens > 0
    n2 = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=1.0, n=2, seed=3)
    assert sorted(ch.index for ch in n2.choices) == [0, 1]


def test_metrics_parse_and_move(server):
    before = metric(server["base"], "jaxserve:generation_tokens_total")
    queued = metric(server["base"], "jaxserve:request_queue_time_seconds_count")
    Client(server["grpc"]).generate("Count: one, two,", max_tokens=5, temperature=0.0)
    assert metric(server["base"], "jaxserve:generation_tokens_total") >= before + 5
    assert metric(server["base"], "jaxserve:request_queue_time_seconds_count") >= queued + 1
    assert metric(server["base"], "jaxserve:time_to_first_token_seconds_count") >= 1
    assert metric(server["base"], "jaxserve:compile_count_after_warmup") == 0


BAD_SAMPLING = [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 100000}, "max_tokens"),
                ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -5}, "top_k"), ({"n": 99}, "n")]


@pytest.mark.parametrize("sampling, field", BAD_SAMPLING)
def test_bad_input_grpc(server, sampling, field):
    client = Client(server["grpc"])
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("hello", **sampling))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


@pytest.mark.parametrize("sampling, field", BAD_SAMPLING)
def test_bad_input_http(server, sampling, field):
    body = json.dumps({"model": MODEL, "prompt": "hello", **sampling}).encode()  # NaN as json.dumps writes it
    status, raw = http("POST", server["base"] + "/v1/completions", body)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert field in err["message"] and err["type"] == "invalid_request_error"


def test_bad_prompts_both_protocols(server):
    client = Client(server["grpc"])
    cases = [("", "prompt"), ("word " * 400, "prompt")]
    for prompt, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(prompt, max_tokens=4))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
        status, raw = http("POST", server["base"] + "/v1/completions",
                           json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode())
        assert status == 400 and field in json.loads(raw)["error"]["message"]
    # Invalid UTF-8: a hand-built protobuf whose text field holds raw bytes 0xff 0xfe.
    channel = grpc.insecure_channel(server["grpc"])
    raw_call = channel.unary_stream("/jaxserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(raw_call(b"\x0a\x02\xff\xfe"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
    status, raw = http("POST", server["base"] + "/v1/completions", b'{"prompt": "\xff\xfe"}')
    assert status == 400 and "UTF-8" in json.loads(raw)["error"]["message"]
    # Oversized messages, unknown model.
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("x" * (2 << 20), max_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in err.value.details()
    # HTTP's 1 MB body limit: the server answers without reading the rest, so a client still sending
    # may see a broken pipe instead of the 400; test_server_robust.py::test_body_limit_stops_reading
    # reads that reply from a raw socket.
    status, raw = http("POST", server["base"] + "/v1/completions",
                       json.dumps({"model": "gpt-17", "prompt": "hi"}).encode())
    assert status == 404 and json.loads(raw)["error"]["param"] == "model"  # OpenAI's model_not_found
    # Still serving.
    text, last = client.generate("The capital of France is", max_tokens=4, temperature=0.0)
    assert last.finish_reason == "length"
    channel.close()


def test_cancel_and_deadline_free_pages(server):
    client = Client(server["grpc"])
    stream = client.stream("Write a very long story:", max_tokens=200, temperature=0.0, ignore_eos=True)
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("Another long story:", max_tokens=200, temperature=0.0, ignore_eos=True, timeout=1.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.time() + 10
    while time.time() < deadline and metric(server["base"], "jaxserve:num_requests_running") > 0:
        time.sleep(0.1)
    assert metric(server["base"], "jaxserve:num_requests_running") == 0
    assert metric(server["base"], "jaxserve:num_requests_waiting") == 0


def test_queue_full_is_resource_exhausted(server):
    client = Client(server["grpc"])
    streams = [client.stream(f"Story {i}:", max_tokens=20, temperature=0.0, ignore_eos=True) for i in range(80)]
    codes = []
    for s in streams:
        try:
            for _ in s:
                pass
            codes.append("ok")
        except grpc.RpcError as e:
            codes.append(e.code())
    assert "ok" in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes


def test_many_streams_half_cancelled(server):
    """Cancelled streams free their pages; the others get exactly what they get alone."""
    import threading

    client = Client(server["grpc"])
    prompts = [f"Fact {i}: the" for i in range(8)]
    alone = {p: client.generate(p, max_tokens=10, temperature=0.0, ignore_eos=True)[0] for p in prompts}
    results: dict[int, str] = {}

    def run(i: int) -> None:
        stream = client.stream(prompts[i % 8], max_tokens=10, temperature=0.0, ignore_eos=True)
        if i % 2:
            next(stream)
            stream.cancel()
            return
        results[i] = "".join(m.text for m in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(120)
    assert len(results) == 32 and all(text == alone[prompts[i % 8]] for i, text in results.items())
    deadline = time.time() + 10
    while time.time() < deadline and metric(server["base"], "jaxserve:num_requests_running") > 0:
        time.sleep(0.1)
    assert metric(server["base"], "jaxserve:num_requests_running") == 0


def test_fuzzed_requests_get_only_documented_codes(server):
    from google.protobuf.message import DecodeError
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    channel = grpc.insecure_channel(server["grpc"])
    raw_call = channel.unary_stream("/jaxserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=64), st.builds(
        lambda text, mt, temp, top_p, top_k, n: pb.GenerateRequest(
            text=text, sampling=pb.SamplingParams(max_tokens=mt, temperature=temp, top_p=top_p, top_k=top_k, n=n)
        ).SerializeToString(),
        st.text(max_size=20), st.integers(-5, 300), st.one_of(st.floats(-1, 3), st.just(float("nan"))), st.floats(-1, 2),
        st.integers(-3, 5), st.integers(-1, 20))))
    def one(raw: bytes) -> None:
        try:
            sampling = pb.GenerateRequest.FromString(raw).sampling
            # Valid but long requests (n=13 x 248 tokens) outlast the deadline on 2 shared cores.
            tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16  # the default
            assume(tokens * max(sampling.n, 1) <= 600)
        except DecodeError:
            pass
        try:
            for _ in raw_call(raw, timeout=60):
                pass
        except grpc.RpcError as e:
            assert e.code() in allowed, (e.code(), e.details())

    one()
    channel.close()


def test_api_key_and_tls(tmp_path):
    """A second server with --api-key and gRPC TLS (a self-signed certificate made here)."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    grpc_port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.serve", "--grpc-port", str(grpc_port), "--http-port",
                             str(http_port), "--api-key", "s3cret", "--tls-cert", str(cert), "--tls-key", str(key),
                             "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128",
                             "--num-pages", "32", "--compilation-cache-dir", xla_cache(tmp_path / "xla")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.time() + 300
        while not (_up(http_port) and http("GET", base + "/health")[0] == 200):
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not become healthy"
            time.sleep(0.5)
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        assert http("POST", base + "/v1/completions", body)[0] == 401
        assert http("POST", base + "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        assert http("POST", base + "/v1/completions", body, {"Authorization": "Bearer s3cret"})[0] == 200
        root = cert.read_bytes()
        options = (("grpc.ssl_target_name_override", "localhost"),)
        channel = grpc.secure_channel(f"127.0.0.1:{grpc_port}", grpc.ssl_channel_credentials(root), options)
        call = channel.unary_stream("/jaxserve.v1.Generation/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
        req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as err:
            list(call(req, timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        msgs = list(call(req, timeout=60, metadata=[("authorization", "Bearer s3cret")]))
        assert msgs[-1].finish_reason == "length"
        channel.close()
    finally:
        proc.kill()


def _up(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_queue_time_is_observed_once_per_request_from_its_first_output():
    """Every streamed output carries the queue time; a request counts once, even if later aborted."""
    from jaxserve.server.metrics import Metrics, RequestTimer

    metrics = Metrics()
    timer = RequestTimer(metrics)
    for queued in (None, 0.25, 0.25, 0.25):  # no output scheduled yet, then three outputs
        timer.on_scheduled(queued)
    timer.on_finish("abort", 0)
    samples = {s.name: s.value for s in metrics.queue.collect()[0].samples}
    assert samples["jaxserve:request_queue_time_seconds_count"] == 1
    assert samples["jaxserve:request_queue_time_seconds_sum"] == 0.25
