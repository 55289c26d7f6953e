"""Issue 19's remaining OpenAI request fields (docs/openai_api.md): `user` (accepted, no effect),
`name` on chat messages (the chat template's to render; refused where the template ignores it),
`best_of` with `n` on completions (vLLM's: best_of candidates, the n of highest cumulative logprob),
`suffix` (refused), `system_fingerprint` in every response and chunk, and the per-route allowlist:
an unknown field is a 400 naming it, accepted-no-effect fields change nothing, refused-unless-unused
fields take only their "not used" value, `skip_special_tokens` is honoured.

The model is a tiny random Llama with the default tokenizer (whose chat template has no names)."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_utils import make_full_vocab_tiny, post, sse

from jaxserve.server.common import InvalidRequest
from jaxserve.server.http_server import render_chat

MSGS = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return make_full_vocab_tiny(tmp_path_factory.mktemp("tiny-fields"))


@pytest.fixture(scope="module")
def fields_srv(tiny_path, tmp_path_factory):
    from server_utils import start_server

    server = start_server(tiny_path, tmp_path_factory.mktemp("xla-fields"))
    yield server
    server["proc"].terminate()
    server["proc"].wait(timeout=60)


@pytest.fixture(scope="module")
def client(fields_srv):
    import openai

    return openai.OpenAI(base_url=fields_srv["base"] + "/v1", api_key="-", max_retries=0)


GREEDY = dict(model="tiny", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})


# ---- name: decided by the chat template (no server needed) ----------------------------------------

def test_a_template_that_renders_names_takes_them_and_one_that_does_not_refuses_them(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    named = [{"role": "user", "content": "hi", "name": "alice"}]
    with pytest.raises(InvalidRequest) as err:  # the default (SmolLM2) template ignores names
        render_chat(tok, named)
    assert err.value.param == "messages[0].name"
    assert render_chat(tok, [{"role": "user", "content": "hi"}])  # without a name: fine
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.get('name') %} ({{ m['name'] }})"
                         "{% endif %}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    with_name = render_chat(tok, named)
    assert with_name != render_chat(tok, [{"role": "user", "content": "hi"}])
    assert "(alice)" in tok.decode(with_name)


# ---- what routers add to the bodies they forward (no server needed) -------------------------------------

# Recorded from vllm-router 0.1.17 and sglang-router 0.3.2 (round_robin) forwarding the minimal
# requests of server_utils.exercise_through_router to a recording proxy: both re-serialize the body
# through SGLang's request types, which writes these defaults (vllm-router adds include_reasoning).
ROUTER_COMPLETION_DEFAULTS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                              "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT_DEFAULTS = {"stream": True, "logprobs": False, "max_completion_tokens": 4, "no_stop_trim": False,
                        "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
                        "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
                        "include_reasoning": True}


def test_the_fields_routers_add_are_accepted():
    from jaxserve.server.openai_models import parse_request

    parse_request({"model": "tiny", "prompt": "Hello there", "max_tokens": 4, **ROUTER_COMPLETION_DEFAULTS}, False)
    parse_request({"model": "tiny", "messages": MSGS, "max_tokens": 4, **ROUTER_CHAT_DEFAULTS}, True)


# ---- through the server -------------------------------------------------------------------------------

@pytest.mark.slow
def test_user_is_accepted_and_changes_nothing(client, fields_srv):
    """`user` is an end-user id for the provider's abuse monitoring: by definition it does not
    steer generation, so the same request with and without it gives the same tokens."""
    for user in ("alice", ""):
        a = client.completions.create(prompt="Hello", user=user, **GREEDY).choices[0].text
        b = client.completions.create(prompt="Hello", **GREEDY).choices[0].text
        assert a == b
        c = client.chat.completions.create(messages=MSGS, user=user, **GREEDY).choices[0].message.content
        d = client.chat.completions.create(messages=MSGS, **GREEDY).choices[0].message.content
        assert c == d
    for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSGS})):
        status, err = post(fields_srv, path, {**base, "max_tokens": 2, "user": 5})
        assert status == 400 and err["error"]["param"] == "user", err


@pytest.mark.slow
def test_system_fingerprint_in_every_response_and_chunk(client):
    a = client.completions.create(prompt="Hello", **GREEDY)
    b = client.chat.completions.create(messages=MSGS, **GREEDY)
    assert a.system_fingerprint and a.system_fingerprint.startswith("fp_")
    assert b.system_fingerprint == a.system_fingerprint  # one server, one configuration
    chunks = list(client.chat.completions.create(messages=MSGS, stream=True, **GREEDY))
    chunks += list(client.completions.create(prompt="Hello", stream=True, **GREEDY))
    assert chunks and all(c.system_fingerprint == a.system_fingerprint for c in chunks)


@pytest.mark.slow
def test_message_names_the_template_ignores_are_400s(fields_srv):
    status, err = post(fields_srv, "/v1/chat/completions",
                       {"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hi", "name": "alice"}], "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "messages[1].name", err
    assert "name" in err["error"]["message"]
    status, err = post(fields_srv, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi", "name": 7}], "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "messages[0].name", err


@pytest.mark.slow
def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **kw)
    ranked = sorted(every.choices, key=lambda c: (-sum(c.logprobs.token_logprobs), c.index))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for: not returned
    assert best.usage.completion_tokens == 4 * 6  # every candidate's tokens count, as OpenAI bills them
    with_lp = client.completions.create(n=1, best_of=4, logprobs=2, **kw)
    assert with_lp.choices[0].text == ranked[0].text
    assert len(with_lp.choices[0].logprobs.top_logprobs[0]) in (2, 3)  # top 2, and the sampled token (as vLLM)
    same = client.completions.create(n=2, best_of=2, **kw)  # best_of == n: plain n
    assert [c.text for c in same.choices] == [c.text for c in every.choices[:2]]


@pytest.mark.slow
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"n": 3, "best_of": 2}),  # best_of < n
    ("/v1/completions", {"best_of": 3, "stream": True}),
    ("/v1/completions", {"best_of": 0}),
    ("/v1/completions", {"best_of": "2"}),
    ("/v1/completions", {"best_of": 17}),
    ("/v1/chat/completions", {"best_of": 2}),  # OpenAI's chat has no best_of
    ("/v1/completions", {"suffix": "end"}),  # no fill-in-the-middle
    ("/v1/chat/completions", {"suffix": "end"}),
])
def test_refused_fields_are_400s_naming_them(fields_srv, path, body):
    base = {"messages": MSGS} if "chat" in path else {"prompt": "hi"}
    if body.get("stream"):
        status, events = sse(fields_srv, path, {**base, "max_tokens": 2, **body})
        err = events[0]
    else:
        status, err = post(fields_srv, path, {**base, "max_tokens": 2, **body})
    field = next(k for k in body if k in ("best_of", "suffix"))
    assert status == 400 and err["error"]["param"] == field, err


# ---- the allowlist: every field honoured or refused ---------------------------------------------------

ROUTES = [("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": MSGS})]
ROUTE_IDS = ["completions", "chat"]


def send(srv: dict, path: str, body: dict, stream: bool = False) -> tuple[int, dict]:
    """(status, the JSON body or, streamed, the error / the last chunk before [DONE])."""
    if not stream:
        return post(srv, path, body)
    status, events = sse(srv, path, body)
    return status, events[0] if status != 200 else events[-2]


def text_of(path: str, out: dict) -> str:
    choice = out["choices"][0]
    return choice["message"]["content"] if "chat" in path else choice["text"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path, base", ROUTES, ids=ROUTE_IDS)
def test_an_unknown_field_is_a_400_naming_it(fields_srv, path, base, stream):
    status, err = send(fields_srv, path, {**base, "max_tokens": 2, "not_a_field": 1}, stream)
    assert status == 400 and err["error"]["param"] == "not_a_field", err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == 400
    assert "not_a_field" in err["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [
    ("max_completion_tokens", 3), ("top_logprobs", 2), ("messages", MSGS),  # chat's own fields
    ("store", False), ("metadata", {}), ("tools", []), ("service_tier", "auto"),
    ("request_id", "r-1"), ("add_special_tokens", True)])  # vLLM extensions not taken here
def test_fields_completions_does_not_take_are_400s(fields_srv, field, value):
    """Silently ignored before the allowlist; each is a 400 naming it now."""
    status, err = post(fields_srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert status == 400 and err["error"]["param"] == field, err


@pytest.mark.slow
@pytest.mark.parametrize("field", ["prompt", "suffix", "request_id", "chat_template_kwargs"])
def test_fields_chat_does_not_take_are_400s(fields_srv, field):
    status, err = post(fields_srv, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, field: "x"})
    assert status == 400 and err["error"]["param"] == field, err


# field -> a value that is accepted and changes nothing (chat; `user` is tested above)
NO_EFFECT = {"store": False, "metadata": {"team": "a"}, "service_tier": "default", "prompt_cache_key": "k-1",
             "safety_identifier": "hash-1", "separate_reasoning": True, "stream_reasoning": False}


@pytest.mark.slow
def test_accepted_no_effect_fields_give_the_same_tokens(fields_srv):
    body = {"messages": MSGS, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    status, plain = post(fields_srv, "/v1/chat/completions", body)
    assert status == 200, plain
    for field, value in NO_EFFECT.items():
        status, out = post(fields_srv, "/v1/chat/completions", {**body, field: value})
        assert status == 200, (field, out)
        assert out["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"], field
    status, out = post(fields_srv, "/v1/chat/completions", {**body, **NO_EFFECT, "store": None, "metadata": None})
    assert status == 200 and out["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"], out


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [
    ("store", True), ("service_tier", "flex"), ("service_tier", "priority"), ("metadata", "x"),
    ("prompt_cache_key", 5), ("safety_identifier", ["x"]), ("separate_reasoning", "yes"),
    ("stream_reasoning", 1)])
def test_accepted_no_effect_fields_check_their_type(fields_srv, field, value):
    status, err = post(fields_srv, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, field: value})
    assert status == 400 and err["error"]["param"] == field, err


# field -> (a real value: refused, the "not used" values: accepted), and whether completions has it
REFUSED_UNLESS_UNUSED = {
    "audio": ({"voice": "alloy", "format": "wav"}, [None], False),
    "prediction": ({"type": "content", "content": "x"}, [None], False),
    "web_search_options": ({}, [None], False),
    "reasoning_effort": ("low", [None], False),
    "verbosity": ("low", [None], False),
    "modalities": (["text", "audio"], [None, ["text"]], False),
    "continue_final_message": (True, [None, False], False),
    "include_reasoning": (False, [None, True], False),
    "prompt_cache_retention": ("24h", [None, "in-memory"], False),
    "no_stop_trim": (True, [None, False], True),
    "return_hidden_states": (True, [None, False], True),
    "spaces_between_special_tokens": (False, [None, True], True),
}


@pytest.mark.slow
@pytest.mark.parametrize("field", list(REFUSED_UNLESS_UNUSED))
def test_refused_unless_unused_fields(fields_srv, field):
    real, unused, on_completions = REFUSED_UNLESS_UNUSED[field]
    for path, base in ROUTES if on_completions else ROUTES[1:]:
        status, err = post(fields_srv, path, {**base, "max_tokens": 1, field: real})
        assert status == 400 and err["error"]["param"] == field, (path, err)
        for value in unused:
            status, out = post(fields_srv, path, {**base, "max_tokens": 1, field: value})
            assert status == 200, (path, value, out)
    if not on_completions:  # a chat-only field is unknown to completions
        status, err = post(fields_srv, "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: unused[-1]})
        assert status == 400 and err["error"]["param"] == field, err


@pytest.mark.slow
@pytest.mark.parametrize("path, base", ROUTES, ids=ROUTE_IDS)
def test_stream_options_keys(fields_srv, path, base):
    body = {**base, "max_tokens": 2}
    for opts, param in (({"include_usage": True, "bogus": True}, "stream_options.bogus"),
                        ({"include_obfuscation": True}, "stream_options.include_obfuscation"),
                        ({"include_usage": "yes"}, "stream_options.include_usage"),
                        ("yes", "stream_options")):
        status, err = send(fields_srv, path, {**body, "stream_options": opts}, stream=True)
        assert status == 400 and err["error"]["param"] == param, (opts, err)
    status, last = send(fields_srv, path, {**body, "stream_options": {"include_usage": True,
                                                                      "include_obfuscation": False}}, stream=True)
    assert status == 200 and last["usage"]["completion_tokens"] == 2, last


IM_START = 1  # a special token of the default tokenizer that is not its EOS


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path, base", ROUTES, ids=ROUTE_IDS)
def test_skip_special_tokens_is_honoured(fields_srv, path, base, stream):
    """logit_bias forces a special token; by default (true) it is left out of the text, with false
    it is written out. The token ids are the same either way."""
    body = {**base, "max_tokens": 3, "temperature": 0, "logit_bias": {str(IM_START): 100},
            "return_token_ids": True}

    def run(**extra) -> tuple[str, list[int]]:
        if not stream:
            status, out = post(fields_srv, path, {**body, **extra})
            assert status == 200, out
            return text_of(path, out), out["choices"][0]["token_ids"]
        status, events = sse(fields_srv, path, {**body, **extra})
        assert status == 200, events
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
        text = "".join(c["delta"].get("content") or "" if "chat" in path else c["text"] for c in chunks)
        return text, [t for c in chunks for t in c.get("token_ids") or []]

    skipped, ids = run()
    assert ids == [IM_START] * 3 and skipped == ""
    assert run(skip_special_tokens=True) == (skipped, ids)
    kept, kept_ids = run(skip_special_tokens=False)
    assert kept_ids == ids and kept == "<|im_start|>" * 3
    status, err = post(fields_srv, path, {**body, "skip_special_tokens": "no"})
    assert status == 400 and err["error"]["param"] == "skip_special_tokens", err


# ---- the request models (jaxserve/server/openai_models.py): nested keys, priority, one field source ----

@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "hi", "nmae": "x"}], "messages[0].nmae"),  # a typo is not dropped
    ([{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}], "messages[0].content[0].cache_control"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[1].type"),
    (MSGS * 2 + [{"role": "user", "content": "r", "tool_call_id": "c1"}], "messages[2].tool_call_id"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    (MSGS + [{"role": "assistant", "content": "no", "refusal": "I can't"}], "messages[1].refusal"),
    (MSGS + [{"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]}],
     "messages[1].annotations"),
])
def test_nested_message_keys_are_checked(messages, param):
    from jaxserve.server.openai_models import parse_request

    with pytest.raises(InvalidRequest) as err:
        parse_request({"messages": messages}, True)
    assert err.value.param == param and param in str(err.value)


def test_an_assistant_message_replayed_from_openai_is_accepted():
    """OpenAI's own responses carry empty refusal/annotations/audio/function_call keys, which an
    agent replays in the history: accepted while empty, and not passed on to the template."""
    from jaxserve.server.openai_models import parse_request

    replayed = {"role": "assistant", "content": "4", "refusal": None, "annotations": [], "audio": None,
                "function_call": None, "tool_calls": None}
    req = parse_request({"messages": MSGS + [replayed, {"role": "user", "content": "and 3+3?"}]}, True)
    assert req.messages[1].for_template() == {"role": "assistant", "content": "4"}


def test_strict_types_and_float_fields_take_ints():
    from jaxserve.server.openai_models import parse_request

    for body, param in (({"n": True}, "n"), ({"stream": 1}, "stream"), ({"temperature": "1"}, "temperature"),
                        ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"), ({"priority": 1.5}, "priority")):
        with pytest.raises(InvalidRequest) as err:
            parse_request({"prompt": "hi", **body}, False)
        assert err.value.param == param, (body, err.value)
    req = parse_request({"prompt": "hi", "temperature": 1, "priority": -3}, False)
    assert req.temperature == 1.0 and isinstance(req.temperature, float) and req.priority == -3


def test_grpc_and_http_take_the_sampling_fields_from_one_model():
    from jaxserve.proto import jaxserve_pb2 as pb
    from jaxserve.server.grpc_server import GrpcSampling, sampling_from_proto
    from jaxserve.server.openai_models import (SAMPLING_FIELDS, ChatCompletionRequest, CompletionRequest,
                                               SamplingFields)

    for model in (CompletionRequest, ChatCompletionRequest, GrpcSampling):
        assert issubclass(model, SamplingFields) and set(SAMPLING_FIELDS) <= set(model.model_fields)
    assert set(pb.SamplingParams.DESCRIPTOR.fields_by_name) == set(GrpcSampling.model_fields) - {
        "logit_bias", "skip_special_tokens", "num_speculative_tokens"}  # (the proto is fixed)
    params = sampling_from_proto(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_k=5, stop=["a"])))
    assert params.top_k == 5 and params.stop == ["a"]
    # what the proto lacks comes in the jaxserve-sampling metadata entry, under the HTTP names
    params = sampling_from_proto(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_k=5)),
                                 {"logit_bias": {"7": -100}, "structured_outputs": {"choice": ["a", "b"]}})
    assert params.top_k == 5 and params.logit_bias == {7: -100} and params.structured_outputs.choice == ["a", "b"]


def _priority_app(policy: str, seen: list):
    """The HTTP app over a fake engine that records the priority each request reaches it with."""
    from types import SimpleNamespace

    from jaxserve.engine.engine import CompletionOutput, RequestOutput
    from jaxserve.server.http_server import build_http_app
    from jaxserve.server.metrics import Metrics

    class FakeEngine:
        accepting = True
        engine = SimpleNamespace(config=SimpleNamespace(scheduling_policy=policy), max_model_len=64, tokenizer=None,
                                 model_config=SimpleNamespace(vocab_size=100))

        async def generate(self, prompt, params, priority=0, **kw):
            seen.append(priority)
            yield RequestOutput("r", None, list(prompt), [CompletionOutput(0, "x", [5], "length")], True)

    return build_http_app(lambda: FakeEngine(), Metrics(), "m")


def test_priority_is_honoured_only_under_priority_scheduling():
    from fastapi.testclient import TestClient

    seen: list[int] = []
    body = {"prompt": [1, 2], "max_tokens": 1}
    with TestClient(_priority_app("priority", seen)) as client:
        assert client.post("/v1/completions", json={**body, "priority": -2}).status_code == 200
    assert seen == [-2]
    with TestClient(_priority_app("fcfs", seen)) as client:
        for value in (0, None):
            assert client.post("/v1/completions", json={**body, "priority": value}).status_code == 200
        r = client.post("/v1/completions", json={**body, "priority": 3})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "priority" and err["type"] == "invalid_request_error", err
    assert seen == [-2, 0, 0]


@pytest.mark.slow
def test_nested_unknown_keys_through_the_server(fields_srv):
    for messages, param in (([{"role": "user", "content": "hi", "weight": 1}], "messages[0].weight"),
                            ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
                             "messages[0].content[0].type")):
        status, err = post(fields_srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert status == 400 and err["error"]["param"] == param, err
        assert err["error"]["type"] == "invalid_request_error" and param in err["error"]["message"]
    status, err = post(fields_srv, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "priority": 1})
    assert status == 400 and err["error"]["param"] == "priority", err  # (fcfs here)
