"""Issue 19: tool calling on /v1/chat/completions (jaxserve/server/tool_calls.py).

Parsers on fixed strings (whole, and streamed in random small chunks: the same result), the request
fields' validation, the prompt (the model's template or our Hermes-style fallback), and, through a
default-model server and the openai client, forced calls (tool_choice required / named) that always
parse and validate against the tool's schema, streamed and not, greedy and sampled.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from jaxserve.server import tool_calls as tc
from jaxserve.server.common import InvalidRequest

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def request(choice="auto", parallel=True, parser="hermes") -> tc.ToolRequest:
    body = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
    r = tc.tools_from_body(body, chat=True)
    r.parser = parser
    return r


def streamed(r: tc.ToolRequest, text: str, seed: int) -> tuple[str, list[dict], str | None]:
    """The text fed in random chunks of 1-5 characters: (content, calls, finish_reason)."""
    rng, stream = random.Random(seed), tc.ToolStream(r)
    pos, content, calls, reason = 0, [], [], None
    while True:
        step = rng.randint(1, 5)
        piece, pos = text[pos:pos + step], pos + step
        done = pos >= len(text)
        c, d, reason = stream.step(piece, done, "stop" if done else None)
        content.append(c)
        calls += d
        if done:
            return "".join(content), calls, reason


def strip_ids(calls: list[dict]) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]


W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
T = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
HERMES_CASES = [  # text, content, calls (name, arguments)
    (f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (f"<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]),
    (f"Let me look.\n<tool_call>{T}</tool_call>", "Let me look.", [("get_time", {"zone": "UTC"})]),
    (f"<tool_call>{T}", None, [("get_time", {"zone": "UTC"})]),  # stopped before the closing tag
    ('<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call> then', None, []),  # broken JSON
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', None, []),  # not one of the tools
    ("Just an answer, 1 < 2 and <tool", "Just an answer, 1 < 2 and <tool", []),
    ("", "", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_parser(text, content, calls):
    r = request()
    message, reason = tc.parse_message(r, text, "stop")
    got = [(c["name"], c["arguments"]) for c in strip_ids(message.get("tool_calls", []))]
    assert got == calls
    if calls:
        assert reason == "tool_calls" and message["content"] == content
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    else:  # unparseable call text stays content
        assert reason == "stop" and message["content"] == text and "tool_calls" not in message
    for seed in range(5):
        s_content, s_calls, s_reason = streamed(r, text, seed)
        assert strip_ids(s_calls) == strip_ids(message.get("tool_calls", [])) and s_reason == reason
        assert s_content.strip() == (message["content"] or "").strip()
        assert [d["index"] for d in s_calls] == list(range(len(s_calls)))


def test_hermes_streams_hold_back_only_a_possible_tag():
    stream = tc.ToolStream(request())
    assert stream.step("Hello <tool", False, None)[0] == "Hello "
    assert stream.step("box> and more", False, None)[0] == "<toolbox> and more"
    content, calls, _ = stream.step("<tool_call>" + T[:10], False, None)
    assert content == "" and calls == []
    content, calls, reason = stream.step(T[10:] + "</tool_call>", True, "stop")
    assert strip_ids(calls) == [{"name": "get_time", "arguments": {"zone": "UTC"}}] and reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_one_call():
    message, _ = tc.parse_message(request(parallel=False), HERMES_CASES[1][0], "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


LLAMA_CASES = [
    (W.replace('"arguments"', '"parameters"'), [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("<|python_tag|>" + W.replace('"arguments"', '"parameters"') + "; " + T.replace('"arguments"', '"parameters"'),
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]),
    ("The time is noon.", []),
    ('{"name": "get_time", "parameters": {"zone": ', []),  # broken JSON
    ('{"name": "other", "parameters": {}}', []),
]


@pytest.mark.parametrize("text, calls", LLAMA_CASES)
def test_llama3_json_parser(text, calls):
    r = request(parser="llama3_json")
    message, reason = tc.parse_message(r, text, "stop")
    assert [(c["name"], c["arguments"]) for c in strip_ids(message.get("tool_calls", []))] == calls
    assert message["content"] == (None if calls else text) and reason == ("tool_calls" if calls else "stop")
    for seed in range(5):
        s_content, s_calls, s_reason = streamed(r, text, seed)
        assert strip_ids(s_calls) == strip_ids(message.get("tool_calls", [])) and s_reason == reason
        assert s_content == (message["content"] or "")


def test_forced_choices_read_the_grammars_json():
    named = request(choice={"type": "function", "function": {"name": "get_time"}})
    assert named.constraint().json == TIME
    message, reason = tc.parse_message(named, '{"zone": "CET"}', "stop")
    assert strip_ids(message["tool_calls"]) == [{"name": "get_time", "arguments": {"zone": "CET"}}]
    assert reason == "tool_calls" and message["content"] is None
    required = request(choice="required", parallel=False)
    schema = required.constraint().json
    assert schema["minItems"] == schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    out = '[{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}]'
    jsonschema.validate(json.loads(out), schema)
    message, _ = tc.parse_message(required, out, "stop")
    assert strip_ids(message["tool_calls"]) == [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]
    message, reason = tc.parse_message(required, '[{"name": "get_we', "length")  # cut by max_tokens
    assert message["content"] == '[{"name": "get_we' and reason == "length"
    assert "maxItems" not in request(choice="required").constraint().json


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_mood"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as info:
        tc.tools_from_body(body, chat=True)
    assert info.value.param == param


def test_chat_takes_not_used_values():
    # (completions refuse every tool field through their allowlist: test_openai_fields.py, and the
    # HTTP test below)
    assert tc.tools_from_body({"tools": [], "tool_choice": "auto"}, chat=True) is None
    assert not tc.tools_from_body({"tools": TOOLS, "tool_choice": "none"}, chat=True).active
    assert tc.tools_from_body({"tools": TOOLS, "response_format": {"type": "json_object"}}, chat=True).choice == "auto"


HISTORY = [{"role": "user", "content": "What is the weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.loading import load_tokenizer

    return load_tokenizer(None)


def test_fallback_prompt_for_a_template_without_tools(tokenizer):
    r = request()
    assert not tc.template_renders_tools(tokenizer)  # SmolLM2's template ignores tools
    msgs, extra = tc.template_inputs(tokenizer, [{**m, "content": m["content"] or ""} for m in HISTORY], r)
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **extra)
    assert r.parser == "hermes" and extra == {}
    assert "<tools>" in text and '"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    msgs, _ = tc.template_inputs(tokenizer, HISTORY[:1], request(choice="none"))
    assert msgs == HISTORY[:1]  # tool_choice none: the tools stay out of the prompt


def test_a_template_that_renders_tools_gets_them(tokenizer):
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                         "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
                         "<|python_tag|>{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
    assert tc.template_renders_tools(tok)
    r = request()
    msgs, extra = tc.template_inputs(tok, [{**m, "content": m["content"] or ""} for m in HISTORY], r)
    assert extra == {"tools": r.tools} and r.parser == "llama3_json"  # (python_tag in the template)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    tc.template_inputs(tok, HISTORY[:1], r, "hermes")
    assert r.parser == "hermes"  # the flag wins over the template


# ---- through a default-model server and the openai client ------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(the name joins conftest's SLOW_FIXTURES: the default model compiles for a minute)"""
    from server_utils import start_default_model_server

    srv = start_default_model_server(tmp_path_factory.mktemp("xla-tools"))
    yield srv
    srv["proc"].terminate()
    srv["proc"].wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="-", max_retries=0)


ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in UTC?"}]


def create(client, stream: bool, **kw):
    """A chat completion; streamed ones are folded back into (content, tool calls, finish_reason)."""
    if not stream:
        r = client.chat.completions.create(model="smol", messages=kw.pop("messages", ASK), **kw)
        c = r.choices[0]
        calls = [{"id": t.id, "type": t.type, "function": {"name": t.function.name, "arguments": t.function.arguments}}
                 for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    chunks = client.chat.completions.create(model="smol", messages=kw.pop("messages", ASK), stream=True, **kw)
    content, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:  # (arguments come in one piece, with the call's id and name)
            assert t.index not in calls and t.id.startswith("call_") and t.type == "function"
            calls[t.index] = {"id": t.id, "type": t.type, "function": {"name": t.function.name,
                                                                       "arguments": t.function.arguments}}
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["function"]["name"] in names and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choices_always_parse_and_validate(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    for temperature, seeds in ((0.0, [0]), (1.0, [1, 2, 3])):
        for seed in seeds:
            for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_time"})):
                content, calls, reason = create(client, stream, tools=TOOLS, tool_choice=choice, max_tokens=96,
                                                temperature=temperature, seed=seed)
                assert reason == "tool_calls" and content is None, (choice, seed, content)
                check_calls(calls, names)
                if choice is named:
                    assert len(calls) == 1


def test_streamed_equals_not_streamed(client):
    for kw in (dict(tool_choice="required", temperature=1.0, seed=5), dict(tool_choice="auto", temperature=0.0)):
        plain = create(client, False, tools=TOOLS, max_tokens=96, **kw)
        streamed_ = create(client, True, tools=TOOLS, max_tokens=96, **kw)
        assert strip_ids(plain[1]) == strip_ids(streamed_[1]) and plain[2] == streamed_[2], kw
        assert (plain[0] or "").strip() == (streamed_[0] or "").strip(), kw
        if plain[1]:
            check_calls(plain[1], {"get_weather", "get_time"})


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        content, calls, reason = create(client, seed % 2 == 1, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=96, temperature=1.0, seed=seed)
        assert len(calls) == 1 and reason == "tool_calls"
        check_calls(calls, {"get_weather", "get_time"})


def test_tool_choice_none_gives_no_calls(client):
    for stream in (False, True):
        content, calls, reason = create(client, stream, tools=TOOLS, tool_choice="none", max_tokens=32)
        assert calls == [] and reason in ("stop", "length") and content


def test_a_second_turn_with_the_tool_result_is_a_normal_answer(client):
    content, calls, reason = create(client, False, messages=HISTORY, max_tokens=32)
    assert calls == [] and reason in ("stop", "length") and content
    first = client.chat.completions.create(model="smol", messages=HISTORY[:1], max_tokens=1)
    second = client.chat.completions.create(model="smol", messages=HISTORY, tools=TOOLS, max_tokens=48)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the calls, results and tools rendered
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_mood"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_http_bad_tool_fields_are_400s_naming_the_field(server, body, param):
    from server_utils import post

    status, err = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and err["error"]["param"] == param, err
    status, err = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "tools": TOOLS})
    assert status == 400 and err["error"]["param"] == "tools", err


def test_each_of_n_streamed_choices_has_its_own_calls(server):
    from server_utils import sse

    status, events = sse(server, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                          "n": 2, "max_tokens": 96, "temperature": 1.0, "seed": 9})
    assert status == 200 and events[-1] == "[DONE]", events
    calls: dict[int, list] = {0: [], 1: []}
    reasons = {}
    for e in events[:-1]:
        for c in e["choices"]:
            calls[c["index"]] += c["delta"].get("tool_calls") or []
            reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        assert [d["index"] for d in calls[index]] == list(range(len(calls[index])))
        check_calls(calls[index], {"get_weather", "get_time"})
