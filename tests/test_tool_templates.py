"""Tool calling through real model families' own chat templates: Qwen2.5-Instruct's (Hermes-style
`<tool_call>` blocks) and Llama 3.1-Instruct's (JSON `{"name", "parameters"}`, tool results in the
`ipython` role, tools in the first user message). The templates in tests/data/chat_templates are
those the models ship in their tokenizer_config.json (their `chat_template` string, unchanged).

No such model can be fetched here (no hub), so each family is a tiny random-weight checkpoint of
its architecture carrying the family's template and special tokens: what the prompt, the parser
and the grammar-enforced choices do depends on the template and the tokenizer, not on the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from jaxserve.server import tool_calls as tc

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                       "properties": {"city": {"type": "string", "maxLength": 20},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "required": ["tz"], "additionalProperties": False,
                       "properties": {"tz": {"type": "string", "maxLength": 12}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
HISTORY = ASK + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]


def family_tokenizer(family: str):
    """The default tokenizer dressed as the family's: its chat template, and for Llama 3 its
    special tokens (BOS, headers, end of turn) as single added tokens."""
    from jaxserve.loading import load_tokenizer

    tok = load_tokenizer(None)
    if family == "llama3":
        tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
        tok.chat_template = (TEMPLATES / "llama3_1_instruct.jinja").read_text()
    else:
        tok.chat_template = (TEMPLATES / "qwen2_5_instruct.jinja").read_text()
    return tok


def make_family_model(root: Path, family: str) -> Path:
    """A 2-layer random checkpoint of the family's architecture (Qwen2: q/k/v biases) whose
    vocabulary is its tokenizer's."""
    import torch
    import transformers

    tok = family_tokenizer(family)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")] \
        if family == "llama3" else tok.eos_token_id
    fields = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=eos)
    cfg = (transformers.LlamaConfig(**fields) if family == "llama3" else transformers.Qwen2Config(**fields))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = root / family
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def render(tok, messages, choice="auto", tools=TOOLS, parallel=True) -> tuple[str, tc.ToolRequest]:
    """The prompt the server renders (tool_calls.template_inputs, then the template) and the request."""
    r = tc.tools_from_body({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}, chat=True)
    msgs, extra = tc.template_inputs(tok, [dict(m) for m in messages], r)
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **extra), r


@pytest.fixture(scope="module", params=["qwen2_5", "llama3"])
def family(request):
    return request.param, family_tokenizer(request.param)


def test_the_models_template_renders_tools_history_and_results(family):
    name, tok = family
    assert tc.template_renders_tools(tok)  # the model's own template, not our fallback prompt
    text, r = render(tok, HISTORY)
    if name == "qwen2_5":
        assert r.parser == "hermes"
        assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
        # the earlier call in Qwen's own <tool_call> form, its arguments an object, not a string
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>') in text
        assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
    else:
        assert r.parser == "llama3_json"
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
        assert "Given the following functions" in text and json.dumps(TOOLS[1], indent=4) in text
        assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
                '{"city": "Paris", "unit": "celsius"}}<|eot_id|>') in text
        # (a string is "iterable" to Jinja: this template writes a tool's text result as a JSON string)
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18 degrees, sunny"<|eot_id|>' in text
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    # tool_choice "none": no tools in the prompt (nothing would read the calls)
    plain, _ = render(tok, ASK, choice="none")
    assert "get_weather" not in plain


def assistant_turn(name: str, text: str) -> str:
    """What the model wrote in the template's rendering of its last (assistant) turn."""
    if name == "qwen2_5":
        body = text.rsplit("<|im_start|>assistant", 1)[1]
        return body.split("<|im_end|>")[0]
    body = text.rsplit("<|start_header_id|>assistant<|end_header_id|>\n\n", 1)[1]
    return body.split("<|eot_id|>")[0]


@pytest.mark.parametrize("calls", [[CALL], [CALL, {"id": "call_2", "type": "function",
                                                   "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]])
def test_calls_written_as_the_template_writes_them_parse_back(family, calls):
    """A call in the model's own format (the template's rendering of an assistant tool call) is read
    back by the parser chosen for that template: same names, same arguments, streamed or whole."""
    name, tok = family
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in calls]}]
    if name == "llama3" and len(calls) > 1:  # (over HTTP: a 400, tested below)
        with pytest.raises(Exception, match="only supports single tool-calls"):
            tok.apply_chat_template(messages, tokenize=False, tools=TOOLS)
        return
    text = tok.apply_chat_template(messages, tokenize=False, tools=TOOLS)
    written = assistant_turn(name, text)
    r = tc.tools_from_body({"tools": TOOLS, "tool_choice": "auto"}, chat=True)
    tc.template_inputs(tok, ASK, r)
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    message, reason = tc.parse_message(r, written, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == want
    stream, got = tc.ToolStream(r), []
    for i in range(0, len(written), 3):  # in 3-character deltas
        _, deltas, _ = stream.step(written[i:i + 3], i + 3 >= len(written), "stop")
        got += [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas]
    assert got == want


# ---- through a server per family and the openai client --------------------------------------

@pytest.fixture(scope="module")
def family_server(tmp_path_factory, family):
    from server_utils import start_server

    name, _ = family
    root = tmp_path_factory.mktemp(f"tools-{name}")
    srv = start_server(make_family_model(root, name), root, name=name,
                       base_args=("--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len",
                                  "1024", "--num-pages", "160"))
    yield name, srv
    srv["proc"].terminate()
    srv["proc"].wait(timeout=60)


@pytest.fixture(scope="module")
def client(family_server):
    import openai

    return family_server[0], openai.OpenAI(base_url=family_server[1]["base"] + "/v1", api_key="-", max_retries=0)


def ask(client, stream: bool, **kw):
    """(content, calls as (name, arguments object), finish_reason) of one chat completion."""
    name, c = client
    kw = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 200, **kw}
    if not stream:
        choice = c.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            content += d.content or ""
            calls += [(t.function.name, json.loads(t.function.arguments)) for t in d.tool_calls or []]
            reason = chunk.choices[0].finish_reason or reason
    return content or None, calls, reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_choices_give_valid_calls(client, stream, choice):
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    for seed in (0, 1):
        content, calls, reason = ask(client, stream, tool_choice=tool_choice, seed=seed, temperature=1.0)
        assert reason == "tool_calls" and calls and not content
        for fn, args in calls:
            assert fn == "get_time" if choice == "named" else fn in SCHEMAS
            jsonschema.validate(args, SCHEMAS[fn])


def test_auto_choice_and_a_second_turn(client):
    name, c = client
    # auto: the random model writes text; it comes back as content or calls, never as an error
    content, calls, reason = ask(client, False, tool_choice="auto", temperature=0)
    assert reason in ("stop", "length", "tool_calls") and (content is not None or calls)
    # the result of a call goes back in, rendered by the template (Qwen: a user turn; Llama: ipython)
    r = c.chat.completions.create(model=name, messages=HISTORY, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tools, the call and its result are in the prompt


def test_llama3_refuses_two_calls_in_one_turn_with_a_400(client):
    import openai

    name, c = client
    two = [{**HISTORY[1], "tool_calls": [CALL, {**CALL, "id": "call_2"}]}]
    if name != "llama3":
        r = c.chat.completions.create(model=name, messages=ASK + two, tools=TOOLS, max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        return
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=name, messages=ASK + two, tools=TOOLS, max_tokens=4)
    assert "single tool-calls" in str(err.value) and err.value.body["param"] == "messages"
