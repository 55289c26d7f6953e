"""Issue 22: what routers and orchestrators read from a replica, against a live server.

vLLM-named Prometheus series (with vLLM's `model_name` label) move by exactly what the requests
did; /ping, /version and SGLang's /model_info, /server_info, /get_load carry our real values; the
client's X-Request-Id names the response, labels the request and comes back in the headers,
streamed or not. The servers are tests/server_utils.py's tiny model (a few seconds to start).
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import post, request, sse, start_server

from jaxserve.server import fleet
from jaxserve.server.common import InvalidRequest

PAGE = 16  # server_utils' servers use the default page size
NUM_PAGES = 96  # server_utils.SERVER_ARGS (one is the null page)
# A prompt of several pages: its repeat must find whole pages in the prefix cache.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 6

VLLM_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")


@pytest.fixture(scope="module")
def fleet_srv(tiny_model, xla_cache):
    server = start_server(tiny_model, xla_cache)
    yield server
    server["proc"].kill()
    server["proc"].wait()


def scrape(srv: dict) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name as exposed, labels) -> value."""
    status, _, raw = request("GET", srv["base"] + "/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(raw.decode()) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, frozenset({"model_name": "tiny", "engine": "0", **labels}.items()))
    assert key in samples, f"{name}{labels} is not exposed with model_name=\"tiny\""
    return samples[key]


def wait_idle(srv: dict, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while value(scrape(srv), "vllm:num_requests_running") or value(scrape(srv), "vllm:num_requests_waiting"):
        assert time.time() < deadline, "the server did not go idle"
        time.sleep(0.1)


@pytest.mark.slow
def test_vllm_metrics_are_exposed_and_move_by_what_the_requests_did(fleet_srv):
    wait_idle(fleet_srv)
    before = scrape(fleet_srv)
    for name in VLLM_COUNTERS + VLLM_GAUGES:
        value(before, name)
    for name in VLLM_HISTOGRAMS:
        value(before, name + "_count")
        value(before, name + "_bucket", le="+Inf")
    for reason in ("stop", "length", "abort"):
        value(before, "vllm:request_success_total", finished_reason=reason)
    config = [labels for (name, labels), v in before.items() if name == "vllm:cache_config_info" and v == 1]
    assert len(config) == 1, "vllm:cache_config_info: one info series, value 1"
    assert {("block_size", str(PAGE)), ("num_gpu_blocks", str(NUM_PAGES - 1)), ("enable_prefix_caching", "True"),
            ("model_name", "tiny")} <= set(config[0])

    body = {"prompt": LONG_PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0.0}
    first = post(fleet_srv, "/v1/completions", body)[1]["usage"]
    repeat = post(fleet_srv, "/v1/completions", body)[1]["usage"]  # the same prefix: served from the cache
    status, events = sse(fleet_srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 4, "ignore_eos": True,
                                                              "stream_options": {"include_usage": True}})
    assert status == 200
    chat = events[-2]["usage"]
    wait_idle(fleet_srv)
    after = scrape(fleet_srv)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    usages = (first, repeat, chat)
    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 5 + 5 + 4
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    # vLLM's prefix-cache counters count tokens: every prompt is queried whole, the repeat hits
    # whole pages of its prefix (what its usage reports as cached).
    assert repeat["prompt_tokens_details"]["cached_tokens"] >= 2 * PAGE
    assert delta("vllm:prefix_cache_hits_total") == repeat["prompt_tokens_details"]["cached_tokens"]
    assert delta("vllm:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert delta(name + "_count") == 3, name
    assert delta("vllm:inter_token_latency_seconds_count") == 4 + 4 + 3  # tokens after the first, one per step
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    # Our own family is still there, beside vLLM's.
    assert value(after, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total") == \
        after[("jaxserve:prompt_tokens_total", frozenset())] - before[("jaxserve:prompt_tokens_total", frozenset())]


@pytest.mark.slow
def test_router_endpoints_carry_the_real_values(fleet_srv, tiny_model):
    status, _, raw = request("GET", fleet_srv["base"] + "/ping")
    assert status == 200
    status, _, raw = request("GET", fleet_srv["base"] + "/version")
    assert status == 200 and json.loads(raw) == {"version": importlib.metadata.version("jaxserve")}

    info = {}
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info", "/get_load"):
        status, _, raw = request("GET", fleet_srv["base"] + path)
        assert status == 200, (path, raw)
        info[path] = json.loads(raw)
    assert info["/model_info"] == info["/get_model_info"]
    model = info["/model_info"]
    assert model["model_path"] == model["tokenizer_path"] == str(tiny_model)  # a directory with its tokenizer
    assert model["served_model_name"] == "tiny" and model["is_generation"] is True and model["model_format"] == "hf"
    assert model["architectures"] == ["LlamaForCausalLM"] and model["max_context_length"] == 128
    server = info["/server_info"]
    assert {k: v for k, v in server.items() if k != "internal_states"} == \
        {k: v for k, v in info["/get_server_info"].items() if k != "internal_states"}
    assert server["served_model_name"] == "tiny" and server["model_path"] == str(tiny_model)
    assert server["version"] == importlib.metadata.version("jaxserve")
    assert server["max_total_num_tokens"] == (NUM_PAGES - 1) * PAGE and server["page_size"] == PAGE
    assert (server["tp_size"], server["dp_size"], server["max_running_requests"]) == (1, 1, 8)
    assert info["/get_load"] == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def stream_with_headers(srv: dict, path: str, body: dict, headers: dict) -> tuple[int, dict, list]:
    conn = http.client.HTTPConnection("127.0.0.1", srv["http_port"], timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    events = [json.loads(line[6:]) for line in (raw.decode().strip() for raw in resp)
              if line.startswith("data: ") and line != "data: [DONE]"]
    conn.close()
    return resp.status, resp.headers, events


@pytest.mark.slow
def test_x_request_id_names_the_request_and_is_echoed(fleet_srv):
    body = {"prompt": "Hello", "max_tokens": 3}
    status, headers, raw = request("POST", fleet_srv["base"] + "/v1/completions", body,
                                   headers={"X-Request-Id": "job-42"})
    assert status == 200 and headers["X-Request-Id"] == "job-42" and json.loads(raw)["id"] == "cmpl-job-42"

    status, headers, events = stream_with_headers(
        fleet_srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        {"X-Request-Id": "job-43"})
    assert status == 200 and headers["X-Request-Id"] == "job-43"
    assert events and {e["id"] for e in events} == {"chatcmpl-job-43"}

    # Without one, the response's own id comes back in the header.
    status, headers, raw = request("POST", fleet_srv["base"] + "/v1/completions", body)
    assert status == 200 and headers["X-Request-Id"] == json.loads(raw)["id"]

    # Several prompts: one label each, the response still named by the client's id.
    status, headers, raw = request("POST", fleet_srv["base"] + "/v1/completions", {**body, "prompt": ["a", "b"]},
                                   headers={"X-Request-Id": "job-44"})
    assert status == 200 and json.loads(raw)["id"] == "cmpl-job-44" and len(json.loads(raw)["choices"]) == 2

    # Not an id: a 400 in OpenAI's shape (and the header still echoed).
    status, headers, raw = request("POST", fleet_srv["base"] + "/v1/completions", body,
                                   headers={"X-Request-Id": "x" * 300})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "request_id" and err["type"] == "invalid_request_error"


@pytest.mark.slow
def test_an_x_request_id_in_flight_is_refused_a_second_time(fleet_srv):
    """The id is the request's label, unique among requests in flight (the engine's id rule)."""
    conn = http.client.HTTPConnection("127.0.0.1", fleet_srv["http_port"], timeout=120)
    long = {"prompt": "Hello", "max_tokens": 110, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(long),
                 {"Content-Type": "application/json", "X-Request-Id": "busy-1"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "busy-1"
    resp.readline()  # the first event: the request is running
    status, raw = post(fleet_srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 2},
                       headers={"X-Request-Id": "busy-1"})
    rest = resp.read().decode()
    conn.close()
    assert status == 400 and raw["error"]["param"] == "request_id" and "already in use" in raw["error"]["message"]
    assert rest.rstrip().endswith("data: [DONE]")  # the first one was not disturbed
    status, raw = post(fleet_srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 2},
                       headers={"X-Request-Id": "busy-1"})
    assert status == 200  # free again once it finished


# ---- without a server -------------------------------------------------------------------------

def test_request_ids_must_be_printable_ascii_without_spaces():
    assert fleet.request_id_from({"X-Request-Id": "a-b_c.1:2"}) == "a-b_c.1:2"
    assert fleet.request_id_from({}) is None
    for bad in ("", "a b", "x" * 257, "caf\u00e9"):
        with pytest.raises(InvalidRequest):
            fleet.request_id_from({"X-Request-Id": bad})


def test_a_gguf_model_says_so(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    engine = SimpleNamespace(engine=SimpleNamespace(
        config=SimpleNamespace(model=str(path)), model_config=SimpleNamespace(vocab_size=100), max_model_len=64,
        eos_token_ids=(2,)))
    info = fleet.model_info(engine, "m")
    assert info["model_format"] == "gguf" and info["tokenizer_path"] == info["model_path"] == str(path)
    assert info["served_model_name"] == "m" and info["architectures"] is None
