"""Tool calling on /v1/chat/completions: the request fields, the prompt, and the model's calls.

- `tools_from_body` validates `tools`, `tool_choice` and `parallel_tool_calls` into a `ToolRequest`.
- `template_inputs` shapes the messages for the chat template: the model's own template renders
  the tools when it can; one that ignores them (it renders the same prompt with and without) gets
  our Hermes-style prompt instead, a system section listing the functions inside `<tools></tools>`,
  with past calls written as `<tool_call>` text and tool results as `<tool_response>` user turns.
- Parsers turn generated text into calls, incrementally (one per choice of a stream; the whole text
  is the same parser fed once, so streamed and non-streamed answers agree): `HermesParser`
  (`<tool_call>{"name", "arguments"}</tool_call>`, Qwen2/3, SmolLM2 and our fallback prompt) and
  `Llama3JsonParser` (`{"name", "parameters"}` objects, optionally after `<|python_tag|>`).
- `tool_choice` "required" or a named function is enforced with the grammar engine: the output is
  constrained to JSON (the function's arguments, or a list of {"name", "parameters"}) and the calls
  are built from that JSON (`ForcedParser`), so such output always parses unless max_tokens cuts it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.server.common import InvalidRequest

PARSERS = ("auto", "hermes", "llama3_json")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    """A chat request's tools. `choice`: "none", "auto", "required" or a function's name."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool = True
    named: bool = False  # `choice` names a function
    parser: str = "hermes"  # how the output is read (set once the prompt is rendered: choose_parser)

    @property
    def active(self) -> bool:
        """Whether the output is read for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and (self.named or self.choice == "required")

    def function(self, name: str) -> dict[str, Any] | None:
        return next((t["function"] for t in self.tools if t["function"]["name"] == name), None)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes a forced choice's output parse: compact JSON (free whitespace lets
        a small model pad until max_tokens)."""
        if not self.forced:
            return None
        if self.named:
            schema = self.function(self.choice).get("parameters") or _EMPTY_PARAMS
        else:
            items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                     "parameters": t["function"].get("parameters") or _EMPTY_PARAMS}}
                     for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def tools_from_body(body: dict[str, Any], chat: bool) -> ToolRequest | None:
    """The request's tools (None when it has none to call); InvalidRequest naming the bad field."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if not chat:  # OpenAI's completions have no tools: the route's allowlist refuses these fields
        return None
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls")
    checked = _check_tools(tools)
    named = False
    if choice is None:
        choice = "auto" if checked else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                 '"function": {"name": ...}}', "tool_choice")
        choice, named = fn["name"], True
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest(f'tool_choice must be "none", "auto", "required" or an object naming a function, '
                             f"got {choice!r}", "tool_choice")
    if (named or choice == "required") and not checked:
        raise InvalidRequest("tool_choice needs tools to choose from", "tool_choice")
    if named and not any(t["function"]["name"] == choice for t in checked):
        raise InvalidRequest(f"tool_choice names {choice!r}, which is not among the tools", "tool_choice")
    request = ToolRequest(checked, choice, True if parallel is None else parallel, named)
    if request.forced and structured_field(body) is not None:
        raise InvalidRequest(f"tool_choice {'naming a function' if named else 'required'} constrains the output "
                             f"itself; it cannot be combined with {structured_field(body)}", "tool_choice")
    return request if checked else None


def structured_field(body: dict[str, Any]) -> str | None:
    from jaxserve.server.structured_fields import structured_outputs_from_body

    return structured_outputs_from_body(body)[1]


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}", "tools")
        if name in names:
            raise InvalidRequest(f"{where}.function.name {name!r} is given twice", "tools")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidRequest(f"{where}.function.description must be a string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema (an object)", "tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise InvalidRequest(f"{where}.function.strict must be a boolean", "tools")
        clean = {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
        out.append({"type": "function", "function": clean})
    return out


# ---- the prompt -------------------------------------------------------------------------------

_RENDERS_TOOLS: dict[str, bool] = {}  # chat template text -> whether it shows tools to the model


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows tools to the model: whether a probe tool changes the
    prompt (probed once per template)."""
    key = json.dumps(getattr(tokenizer, "chat_template", None))
    if key not in _RENDERS_TOOLS:
        msgs = [{"role": "user", "content": "x"}]
        probe = [{"type": "function", "function": {"name": "probe_tool_name", "description": "d",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            with_tools = tokenizer.apply_chat_template(msgs, tools=probe, tokenize=False, add_generation_prompt=True)
            plain = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            _RENDERS_TOOLS[key] = with_tools != plain
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            _RENDERS_TOOLS[key] = False
    return _RENDERS_TOOLS[key]


def fallback_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Our tools section (Hermes's layout, our words), for templates that do not render tools."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call functions to help answer the user. These are the functions you may "
            f"call, described as JSON:\n<tools>\n{listing}\n</tools>\n\nTo call a function, answer with "
            "a JSON object holding its name and its arguments inside <tool_call></tool_call> tags, one "
            "block per call, like this:\n<tool_call>\n"
            '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
            "The results come back inside <tool_response></tool_response> tags.")


def _arguments_obj(arguments: Any) -> Any:
    """A call's arguments as an object where they are a JSON string of one (templates tojson them)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _history_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Past calls and results for a template that knows neither: calls as <tool_call> text in the
    assistant's turn, results (consecutive ones together) as <tool_response> text in a user turn."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            for call in m["tool_calls"]:
                fn = call.get("function") or {}
                parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"),
                                                           "arguments": _arguments_obj(fn.get("arguments"))},
                                                          ensure_ascii=False) + "\n</tool_call>")
            rest = {k: v for k, v in m.items() if k not in ("tool_calls", "content")}
            out.append({**rest, "content": "\n".join(parts)})
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def check_history(messages: list[dict[str, Any]]) -> None:
    """The shape of past assistant tool_calls (OpenAI's), so that templates get what they expect."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None:
            continue
        where = f"messages[{i}].tool_calls"
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise InvalidRequest(f"{where} must be a list, on an assistant message", "messages")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                    not isinstance(fn.get("arguments"), (str, dict)):
                raise InvalidRequest(f'{where}[{j}] must be {{"id", "type": "function", "function": '
                                     '{"name", "arguments"}}', "messages")


def template_inputs(tokenizer: Any, messages: list[dict[str, Any]], request: ToolRequest | None,
                    parser_flag: str = "auto") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template arguments); sets `request.parser` (choose_parser).
    With tool_choice "none" the tools are left out of the prompt (nothing would read the calls)."""
    msgs, extra, fallback = _template_inputs(tokenizer, messages, request)
    if request is not None:
        request.parser = choose_parser(parser_flag, tokenizer, fallback)
    return msgs, extra


def _template_inputs(tokenizer: Any, messages: list[dict[str, Any]],
                     request: ToolRequest | None) -> tuple[list[dict[str, Any]], dict[str, Any], bool]:
    check_history(messages)
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    show = request is not None and request.active
    if not show and not has_history:
        return messages, {}, False
    if template_renders_tools(tokenizer):
        msgs = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": _arguments_obj(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
        return msgs, ({"tools": request.tools} if show else {}), False
    msgs = _history_as_text(messages)
    if show:
        section = fallback_system_prompt(request.tools)
        if msgs[0]["role"] in ("system", "developer"):
            msgs = [{**msgs[0], "content": msgs[0]["content"] + "\n\n" + section}] + msgs[1:]
        else:
            msgs = [{"role": "system", "content": section}] + msgs
    return msgs, {}, show


def choose_parser(flag: str, tokenizer: Any, fallback_prompt: bool) -> str:
    """hermes or llama3_json: our fallback prompt asks for Hermes calls; otherwise the flag, or
    what the chat template itself writes."""
    if fallback_prompt:
        return "hermes"
    if flag != "auto":
        return flag
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


# ---- the output ---------------------------------------------------------------------------------

def new_call(name: str, arguments: Any) -> dict[str, Any]:
    """OpenAI's tool call object; arguments as a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


class ToolParser:
    """Incremental: `feed` text, then `finish`; each returns (content, calls) found so far. The
    content it returns never holds text that may still turn out to be part of a call."""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: set[str]):
        self.names = names
        self.buf = ""
        self.in_call = False

    def _call(self, body: str) -> dict[str, Any] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return new_call(obj["name"], args) if isinstance(args, (dict, str)) else None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        content, calls = [], []
        while True:
            if not self.in_call:
                at = self.buf.find(self.OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buf, self.OPEN)
                    content.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self.buf[:at])
                self.buf, self.in_call = self.buf[at + len(self.OPEN):], True
            else:
                at = self.buf.find(self.CLOSE)
                if at < 0:
                    break
                body = self.buf[:at]
                call = self._call(body)
                if call is None:  # not a call after all: the text stays content
                    content.append(self.OPEN + body + self.CLOSE)
                else:
                    calls.append(call)
                self.buf, self.in_call = self.buf[at + len(self.CLOSE):], False
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        buf, self.buf = self.buf, ""
        if not self.in_call:
            return buf, []
        call = self._call(buf)  # an unclosed last call (the model stopped before its tag) still counts
        return ("", [call]) if call is not None else (self.OPEN + buf, [])


class Llama3JsonParser(ToolParser):
    """Llama 3's JSON calls: the whole output is calls (`;`-separated) when it starts with `{` or
    `<|python_tag|>`; otherwise plain content. Calls are buffered to the end: a partial object
    cannot be told from a broken one before it."""

    TAG = "<|python_tag|>"

    def __init__(self, names: set[str]):
        self.names = names
        self.buf = ""
        self.mode: str | None = None  # None: undecided, "text", "calls"

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.mode == "text":
            return text, []
        self.buf += text
        head = self.buf.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return "", []
        if head.startswith("{") or head.startswith(self.TAG):
            self.mode = "calls"
            return "", []
        self.mode, out, self.buf = "text", self.buf, ""
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        buf, self.buf = self.buf, ""
        if self.mode != "calls":
            return buf, []
        text = buf.lstrip()
        if text.startswith(self.TAG):
            text = text[len(self.TAG):]
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos == len(text):
                break
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return buf, []
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(args, dict) or obj.get("name") not in self.names:
                return buf, []
            calls.append(new_call(obj["name"], args))
        return ("", calls) if calls else (buf, [])


class ForcedParser(ToolParser):
    """tool_choice required or named: the output is the grammar's JSON, read at the end."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.buf = ""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        try:
            value = json.loads(self.buf)
        except ValueError:  # cut by max_tokens: the partial JSON is returned as content
            return self.buf, []
        if self.request.named:
            return "", [new_call(self.request.choice, value)]
        return "", [new_call(item["name"], item["parameters"]) for item in value]


def make_parser(request: ToolRequest) -> ToolParser:
    if request.forced:
        return ForcedParser(request)
    names = {t["function"]["name"] for t in request.tools}
    return Llama3JsonParser(names) if request.parser == "llama3_json" else HermesParser(names)


@dataclass
class ToolStream:
    """One choice's stream: each engine delta becomes (content, new tool_calls deltas, finish_reason)."""

    request: ToolRequest
    parser: ToolParser = field(init=False)
    count: int = 0

    def __post_init__(self) -> None:
        self.parser = make_parser(self.request)

    def step(self, text: str, finished: bool, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        content, calls = self.parser.feed(text)
        if finished:
            more, extra = self.parser.finish()
            content, calls = content + more, calls + extra
        if not self.request.parallel:  # at most one call: later ones are dropped
            calls = calls[:max(0, 1 - self.count)]
        deltas = [{"index": self.count + i, **c} for i, c in enumerate(calls)]
        self.count += len(calls)
        if finished and self.count and finish_reason in ("stop", "length"):
            finish_reason = "tool_calls"
        return content, deltas, finish_reason


def parse_message(request: ToolRequest, text: str,
                  finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole output as OpenAI's assistant message (content null when only calls) and finish_reason."""
    stream = ToolStream(request)
    content, deltas, finish_reason = stream.step(text, True, finish_reason)
    if not deltas:
        return {"role": "assistant", "content": content}, finish_reason
    calls = [{k: v for k, v in d.items() if k != "index"} for d in deltas]
    return {"role": "assistant", "content": content.strip() or None, "tool_calls": calls}, finish_reason
