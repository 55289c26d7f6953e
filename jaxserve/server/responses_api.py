"""OpenAI's Responses API, `POST /v1/responses`: stateless, text and function tools.

A Responses request is translated into the chat-completions body that the chat route already
understands (`chat_body`): `instructions` and the `input` items become chat messages
(`function_call` items an assistant turn's `tool_calls`, `function_call_output` items `tool`
messages), flat function tools become chat tools, `text.format` becomes `response_format`,
`max_output_tokens` becomes `max_tokens`. Sampling, prompt rendering, grammars and tool parsing
are then the chat route's own (`ChatPath`, handed over by http_server.py), so both routes give
the same tokens for the same messages. What comes back is shaped into Responses' output items,
streamed as its typed SSE events (`OutputBuilder`).

Nothing is stored: `previous_response_id` and `conversation` are refused (400 naming them),
`store` is accepted and every response says `"store": false`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxserve.server import fleet, tool_calls
from jaxserve.server.common import (EngineFailure, InvalidRequest, NotFound, NotReady, Overloaded, check_for_model,
                                    stream_outputs)

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# Accepted fields; each has its own check in chat_body.
_HANDLED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
            "parallel_tool_calls", "text", "stream", "store", "metadata", "user", "safety_identifier",
            "prompt_cache_key", "stream_options"}
# vLLM's extra sampling fields, passed through as the chat route takes them.
_EXTRAS = ("top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")
# OpenAI fields this server cannot honour: allowed only with the value(s) that mean "not used".
_NOT_USED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,), "conversation": (None,), "background": (None, False),
    "prompt": (None,), "include": (None, []), "truncation": (None, "disabled"), "max_tool_calls": (None,),
    "top_logprobs": (None, 0), "service_tier": (None, "auto", "default"),
}
# Where a chat-route error names a chat field, the client sent its Responses spelling.
_PARAM_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}


@dataclass
class ChatPath:
    """The chat route's pieces (closures of build_http_app) that /v1/responses runs on."""

    body_of: Callable[[Request], Awaitable[dict[str, Any]]]
    parse: Callable[[dict[str, Any], bool], Any]  # a chat body -> its ChatCompletionRequest
    engine_or_raise: Callable[[], Any]
    sampling: Callable[[Any, bool], Any]
    compile_grammar: Callable[..., Awaitable[None]]
    prepare: Callable[..., Awaitable[tuple[list[list[int]], list[str | None]]]]
    fit_max_tokens: Callable[..., Any]
    run_all: Callable[..., Awaitable[Any]]
    until_disconnect: Callable[..., Awaitable[tuple[bool, Any]]]
    error_response: Callable[[BaseException], Response]
    metrics: Any
    model_name: str


# ---- the request ------------------------------------------------------------------------------

def _same(value: Any, fine: Any) -> bool:
    return value == fine and type(value) is type(fine)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined as the chat route joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of input_text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.content[{j}]: only input_text / output_text parts are supported, "
                                 f"got {kind!r}", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages (InvalidRequest naming `input` or `instructions`)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequest(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise InvalidRequest(f"{where}.{key} must be a string", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls join the assistant turn before them
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where}.call_id must be a string", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"{where}.output")})
        else:
            raise InvalidRequest(f"{where}.type {kind!r} is not supported (message, function_call and "
                                 "function_call_output items are)", "input")
    return messages


def chat_tools(body: dict[str, Any]) -> dict[str, Any]:
    """`tools` / `tool_choice` / `parallel_tool_calls` in the chat route's shape."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest('tools must be a list of {"type": "function", "name", ...}', "tools")
        converted = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise InvalidRequest(f"tools[{i}]: only function tools are supported, got {kind!r}", "tools")
            unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
            if unknown:
                raise InvalidRequest(f"tools[{i}].{unknown[0]} is not supported", "tools")
            converted.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        out["tools"] = converted
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "name"}',
                                 "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as the chat route's `response_format`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequest("text must be an object", "text")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise InvalidRequest(f"text.{unknown[0]} is not supported", "text")
    if text.get("verbosity") not in (None, "medium"):  # OpenAI's default; no other level exists here
        raise InvalidRequest("text.verbosity is not supported", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("text.format.type must be 'text', 'json_object' or 'json_schema'", "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body that does what this Responses body asks; refuses by name what
    cannot be done (unknown fields too)."""
    for name in body:
        if name not in _HANDLED and name not in _EXTRAS and name not in _NOT_USED and name != "reasoning":
            raise InvalidRequest(f"{name} is not a /v1/responses field supported by this server", name)
    for name, fine in _NOT_USED.items():
        if name in body and not any(_same(body[name], f) for f in fine):
            why = " (nothing is stored: send the whole conversation as input)" \
                if name in ("previous_response_id", "conversation") else ""
            raise InvalidRequest(f"{name} is not supported by this server{why}", name)
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or reasoning.get("effort") not in (None, "none")
                                  or reasoning.get("summary") is not None):
        raise InvalidRequest("reasoning is not supported by this server (null or effort none only)", "reasoning")
    for name in ("user", "safety_identifier", "prompt_cache_key"):  # accepted; they do not steer generation
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidRequest(f"{name} must be a string", name)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise InvalidRequest("stream must be a boolean", "stream")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise InvalidRequest("store must be a boolean", "store")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise InvalidRequest("metadata must map at most 16 keys (64 characters) to strings (512)", "metadata")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_obfuscation"}):
        raise InvalidRequest("stream_options may only hold include_obfuscation", "stream_options")
    if opts is not None and opts.get("include_obfuscation") not in (None, False):  # (no padding is sent)
        raise InvalidRequest("stream_options.include_obfuscation is not supported by this server",
                             "stream_options.include_obfuscation")
    chat: dict[str, Any] = {"messages": input_messages(body), **chat_tools(body)}
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", *_EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    return chat


def _renamed(exc: InvalidRequest) -> InvalidRequest:
    """A chat-route error with the Responses field names."""
    param = exc.param or ""
    head = param.split("[")[0].split(".")[0]
    if head not in _PARAM_NAMES:
        return exc
    message = str(exc).replace("response_format.json_schema", "text.format").replace("response_format", "text.format")
    message = message.replace("max_tokens", "max_output_tokens")
    return InvalidRequest(message, _PARAM_NAMES[head])


# ---- the response -----------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def echoed_settings(body: dict[str, Any], model_name: str) -> dict[str, Any]:
    """The request's settings as the response object repeats them (OpenAI's defaults where absent)."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    return {
        "model": model_name, "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "tools": [{"description": None, "parameters": None, "strict": None, **t} for t in tools],
        "tool_choice": choice if choice is not None else "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"),
        "text": {"format": {"type": "text"}, **(body.get("text") or {})},
        "previous_response_id": None, "reasoning": None, "truncation": "disabled", "background": False,
        "user": body.get("user"), "store": False, "service_tier": "default", "error": None,
    }


def response_object(rid: str, created: float, settings: dict[str, Any], status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "incomplete_details": incomplete, **settings, "output": output, "usage": usage}


def usage_of(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class OutputBuilder:
    """Engine text deltas -> Responses output items and their stream events. A whole output is one
    `step` (non-streamed), a stream one step per delta: the same code builds both answers.

    With tools, the text around calls goes through the chat route's ToolStream; the message's text
    is then stripped of surrounding whitespace (held back while it may be trailing) and the message
    is left out when only calls remain, as the chat route's content is null then."""

    def __init__(self, tools: tool_calls.ToolRequest | None):
        self.tools = tools if tools is not None and tools.active else None
        self.stream = tool_calls.ToolStream(self.tools) if self.tools is not None else None
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None
        self.pending = ""  # whitespace held back (tools only)
        self.incomplete = False

    def _open_message(self, events: list) -> dict[str, Any]:
        if self.message is None:
            self.message = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                            "content": []}
            index = len(self.output)
            self.output.append(self.message)
            events.append(("response.output_item.added", {"output_index": index, "item": _copy(self.message)}))
            part = {"type": "output_text", "text": "", "annotations": []}
            self.message["content"].append(part)
            events.append(("response.content_part.added", {"item_id": self.message["id"], "output_index": index,
                                                           "content_index": 0, "part": _copy(part)}))
        return self.message

    def _text(self, text: str, events: list) -> None:
        if self.tools is not None:  # strip: hold whitespace back until text follows it
            self.pending += text
            body = self.pending.rstrip()
            if not body:
                return
            if self.message is None:
                body = body.lstrip()
            text, self.pending = body, self.pending[len(self.pending.rstrip()):]
        if not text:
            return
        message = self._open_message(events)
        message["content"][0]["text"] += text
        index = self.output.index(message)
        events.append(("response.output_text.delta", {"item_id": message["id"], "output_index": index,
                                                      "content_index": 0, "delta": text, "logprobs": []}))

    def _call(self, call: dict[str, Any], events: list) -> None:
        fn = call["function"]
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                "name": fn["name"], "arguments": ""}
        index = len(self.output)
        self.output.append(item)
        events.append(("response.output_item.added", {"output_index": index, "item": _copy(item)}))
        events.append(("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                                  "delta": fn["arguments"]}))
        item.update(arguments=fn["arguments"], status="completed")
        events.append(("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                 "name": fn["name"], "arguments": fn["arguments"]}))
        events.append(("response.output_item.done", {"output_index": index, "item": _copy(item)}))

    def step(self, text: str, finished: bool, finish_reason: str | None) -> list[tuple[str, dict[str, Any]]]:
        """The events for one engine delta (and, when `finished`, for closing the output)."""
        events: list[tuple[str, dict[str, Any]]] = []
        if self.stream is not None:
            text, calls, _ = self.stream.step(text, finished, finish_reason)
        else:
            calls = []
        self._text(text, events)
        for call in calls:
            self._call(call, events)
        if not finished:
            return events
        self.incomplete = finish_reason == "length"
        if self.message is None and not self.output:  # no text and no calls: still one (empty) message
            self._open_message(events)
        if self.message is not None:
            message, index = self.message, self.output.index(self.message)
            part = message["content"][0]
            message["status"] = "incomplete" if self.incomplete else "completed"
            events.append(("response.output_text.done", {"item_id": message["id"], "output_index": index,
                                                         "content_index": 0, "text": part["text"], "logprobs": []}))
            events.append(("response.content_part.done", {"item_id": message["id"], "output_index": index,
                                                          "content_index": 0, "part": _copy(part)}))
            events.append(("response.output_item.done", {"output_index": index, "item": _copy(message)}))
        return events


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


# ---- the route ----------------------------------------------------------------------------------

def endpoint(path: ChatPath) -> Callable[[Request], Awaitable[Response]]:
    """The `POST /v1/responses` handler."""

    async def responses(request: Request) -> Response:
        try:
            client_id = fleet.request_id_from(request.headers)
            body = await path.body_of(request)
            try:
                chat = chat_body(body)
                req = path.parse(chat, True)
                tools = tool_calls.tools_from_body(chat, True)
                engine = path.engine_or_raise()
                params = path.sampling(req, True)
                if tools is not None and tools.forced:
                    params.structured_outputs = tools.constraint()
                check_for_model(params, engine)
                await path.compile_grammar(engine, chat, params)
                disconnected, prepared = await path.until_disconnect(request,
                                                                     path.prepare(engine, req, True, 1, tools))
                if disconnected:
                    return Response(status_code=499)
                prompts, texts = prepared
                params = path.fit_max_tokens(engine, params, prompts)
            except InvalidRequest as exc:
                raise _renamed(exc) from None
            rid = "resp_" + (client_id or uuid.uuid4().hex[:24])
            label = client_id or rid
            headers = {fleet.REQUEST_ID_HEADER: label}
            settings = echoed_settings(body, path.model_name)
            created = int(time.time())
            if body.get("stream"):
                stream = _events(path, engine, prompts[0], texts[0], params, label, tools, rid, created, settings)
                # Admission errors are still a 400/429 here: the first event waits for the engine's first output.
                disconnected, first = await path.until_disconnect(request, stream.__anext__())
                if disconnected:
                    await stream.aclose()
                    return Response(status_code=499)
                return StreamingResponse(_prepend(first, stream), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
            disconnected, ran = await path.until_disconnect(request, path.run_all(engine, prompts, texts, params,
                                                                                  [label]))
            if disconnected:
                return Response(status_code=499)
            results, usage, _ = ran
            comp = results[(0, 0)]
            builder = OutputBuilder(tools)
            builder.step(comp.text, True, comp.finish_reason)
            status = "incomplete" if builder.incomplete else "completed"
            obj = response_object(rid, created, settings, status, builder.output,
                                  usage_of(usage["prompt_tokens"], usage["completion_tokens"], usage["cached"]))
            return JSONResponse(obj, headers=headers)
        except (InvalidRequest, NotFound, Overloaded, NotReady, EngineFailure) as exc:
            return path.error_response(exc)
        except Exception as exc:  # noqa: BLE001 - this request alone fails, in OpenAI's shape
            logging.getLogger(__name__).exception("request failed")
            return path.error_response(exc)

    return responses


async def _events(path: ChatPath, engine: Any, prompt: list[int], text: str | None, params: Any, label: str,
                  tools: tool_calls.ToolRequest | None, rid: str, created: int,
                  settings: dict[str, Any]) -> AsyncIterator[str]:
    """The SSE events of one streamed response. Nothing is sent before the engine's first output,
    so an admission error is still the handler's plain 4xx/5xx answer."""
    seq = 0

    def sse(kind: str, payload: dict[str, Any]) -> str:
        nonlocal seq
        data = json.dumps({"type": kind, "sequence_number": seq, **payload})
        seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    outs = stream_outputs(engine, path.metrics, prompt, params, request_id=label, prompt_text=text)
    builder = OutputBuilder(tools)
    started = False
    try:
        async for out in outs:
            if not started:
                started = True
                shell = response_object(rid, created, settings, "in_progress", [], None)
                yield sse("response.created", {"response": shell})
                yield sse("response.in_progress", {"response": shell})
            comp = out.outputs[0]
            reason = comp.finish_reason if out.finished else None
            for kind, payload in builder.step(out.delta_text, out.finished, reason):
                yield sse(kind, payload)
            if out.finished:
                status = "incomplete" if builder.incomplete else "completed"
                usage = usage_of(len(out.prompt_token_ids), len(comp.token_ids), out.num_cached_tokens)
                final = response_object(rid, created, settings, status, builder.output, usage)
                yield sse(f"response.{status}", {"response": final})
    except Exception as exc:  # noqa: BLE001 - after the first event the failure travels as an error event
        if not started:
            raise
        param = getattr(exc, "param", None)
        yield sse("error", {"code": type(exc).__name__, "message": str(exc) or type(exc).__name__, "param": param})
    finally:
        await outs.aclose()


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item
