"""OpenAI-compatible HTTP front end (FastAPI): completions, chat completions, models, health, metrics.

Request bodies are parsed into the pydantic models of server/openai_models.py (every field
honoured or refused by name) before anything reaches the engine; prompts are
tokenized (and chat templates applied) in a worker thread, outside the engine's lock, so a big
prompt stalls neither the event loop nor the running batch. Every error is OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`; a stream that fails after it started sends an
error event and still ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.server import fleet
from jaxserve.server.common import (Completion, EngineFailure, InvalidRequest, NotFound, NotReady, Overloaded,
                                    check_for_model, check_sequences, check_text_size, max_token_chars,
                                    stream_outputs)
from jaxserve.server.metrics import Metrics
from jaxserve.server import responses_api, tool_calls
from jaxserve.server.openai_models import (ChatCompletionRequest, CompletionRequest, parse_request,
                                           sampling_params)
from jaxserve.server.structured_fields import structured_outputs_from_body

access_log = logging.getLogger("jaxserve.access")

_REQUEST_ID_KEY = fleet.REQUEST_ID_HEADER.lower().encode("latin-1")  # ASGI header names are lower-case bytes
RETRY_AFTER_429 = "1"
RETRY_AFTER_503 = "5"


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: Any = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status if code is None else code}},
                        status_code=status, headers=headers)


def error_event(exc: BaseException) -> str:
    """The SSE event a stream sends when it fails after it started (then `data: [DONE]`)."""
    status, kind, param = _classify(exc)
    body = {"error": {"message": str(exc) or type(exc).__name__, "type": kind, "param": param, "code": status}}
    return f"data: {json.dumps(body)}\n\n"


def _classify(exc: BaseException) -> tuple[int, str, str | None]:
    if isinstance(exc, InvalidRequest):
        return 400, "invalid_request_error", exc.param
    if isinstance(exc, NotFound):
        return 404, "invalid_request_error", exc.param
    if isinstance(exc, Overloaded):
        return 429, "rate_limit_error", None
    if isinstance(exc, NotReady):
        return 503, "service_unavailable", None
    return 500, "server_error", None


def error_response(exc: BaseException) -> JSONResponse:
    status, kind, param = _classify(exc)
    headers = {"Retry-After": RETRY_AFTER_429} if status == 429 else \
        {"Retry-After": RETRY_AFTER_503} if status == 503 else None
    code = "model_not_found" if isinstance(exc, NotFound) else None
    message = str(exc) if status != 500 or isinstance(exc, EngineFailure) else f"internal error: {exc}"
    return error(status, message, kind, param, code, headers)


class _AuthAndAccessLog:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide the client's disconnect from handlers):
    the API key on /v1/, one access-log line per request, and the client's X-Request-Id echoed on
    every response (streamed or not, errors too), as vLLM does: routers and proxies correlate by it."""

    def __init__(self, app: Any, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        status = {"code": 0}
        headers = dict(scope.get("headers") or [])
        client_id = headers.get(_REQUEST_ID_KEY)

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if client_id is not None:  # the handler's own id (no client id) stays as it set it
                    rest = [(k, v) for k, v in message.get("headers", []) if k.lower() != _REQUEST_ID_KEY]
                    message = {**message, "headers": rest + [(_REQUEST_ID_KEY, client_id)]}
            await send(message)

        if self.api_key is not None and scope["path"].startswith("/v1/"):
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                response = error(401, "missing or wrong API key", "authentication_error")
                await response(scope, receive, send_and_note)
                self._log(scope, 401, start)
                return

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self._log(scope, status["code"], start)

    @staticmethod
    def _log(scope: dict, status: int, start: float) -> None:
        client = scope.get("client") or ("-", 0)
        access_log.info('%s "%s %s" %d %.1f ms', client[0], scope.get("method"), scope.get("path"), status,
                        (time.monotonic() - start) * 1000)


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` unless the client disconnects first: (disconnected, result). Waits on the ASGI
    receive channel (no polling): after the body, the next message is http.disconnect."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancelled on purpose; pages are freed by its finally
                pass
    if task.cancelled():
        return True, None
    return False, task.result()


def build_http_app(get_engine: Callable[[], Any], metrics: Metrics, model_name: str, api_key: str | None = None,
                   max_request_bytes: int = 1 << 20, max_sequences_per_request: int = 128,
                   debug_endpoints: bool = False, tool_call_parser: str = "auto") -> FastAPI:
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_AuthAndAccessLog, api_key=api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, str(exc))

    async def body_of(request: Request) -> dict[str, Any]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype and ctype != "application/json" and not ctype.endswith("+json"):
            raise InvalidRequest(f"Content-Type must be application/json, got {ctype!r}")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            raise InvalidRequest(f"request body is {declared} bytes, the limit is {max_request_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:  # stop reading: the connection is closed after our 400
                raise InvalidRequest(f"request body is over {max_request_bytes} bytes, the limit")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidRequest("request body is not valid UTF-8") from None
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object")
        for key, value in body.items():
            _check_strings(value, key)
        model = body.get("model")
        if model is not None and model != model_name:
            raise NotFound(f"the model {model!r} does not exist; this server serves {model_name!r}", "model")
        return body

    def sampling(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> Any:
        """SamplingParams of a parsed request (its ranges are checked there)."""
        extra: dict[str, Any] = {}
        if isinstance(req, ChatCompletionRequest):
            extra["max_tokens"] = req.max_completion_tokens if req.max_completion_tokens is not None \
                else req.max_tokens
            if req.logprobs:
                extra["logprobs"] = 0 if req.top_logprobs is None else req.top_logprobs
        else:
            extra["logprobs"] = req.logprobs
            if req.echo and req.logprobs is not None:
                extra["prompt_logprobs"] = req.logprobs
            extra["max_tokens"] = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's completions default
        params = sampling_params(req, **extra)
        params.structured_outputs, _ = structured_outputs_from_body(dict(req))  # (validated there)
        if chat and extra["max_tokens"] is None:
            params.max_tokens = None  # OpenAI's chat default: the rest of the context (set per prompt)
        return params

    def priority_of(req: CompletionRequest | ChatCompletionRequest, engine: Any) -> int:
        """vLLM's `priority` (lower runs first): honoured when the engine schedules by priority;
        otherwise only 0 / null, as vLLM refuses it ("priority scheduling is not enabled")."""
        if not req.priority:
            return 0
        if engine.engine.config.scheduling_policy != "priority":
            raise InvalidRequest("priority is only honoured when the server runs --scheduling-policy priority; "
                                 "send 0 or null", "priority")
        return req.priority

    async def compile_grammar(engine: Any, body: dict[str, Any], params: Any) -> None:
        """Compile a structured-output grammar off the event loop (cached for the engine's use):
        one that does not compile is a 400 naming the field it came from."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(engine.engine.grammars.compile, params.structured_outputs)
        except ValueError as exc:
            # (no structured-output field: the grammar is a forced tool_choice's, from `tools`)
            raise InvalidRequest(str(exc), structured_outputs_from_body(body)[1] or "tools") from None

    fingerprints: dict[int, str] = {}

    def system_fingerprint(engine: Any) -> str:
        """OpenAI's system_fingerprint: names the backend configuration (jaxserve's version, the
        model and every engine setting), so a client sees when a change may change outputs."""
        key = id(engine.engine)
        if key not in fingerprints:
            setup = repr((fleet.server_version(), model_name, engine.engine.config))
            fingerprints[key] = "fp_" + hashlib.sha256(setup.encode()).hexdigest()[:12]
        return fingerprints[key]

    def engine_or_raise() -> Any:
        engine = get_engine()
        if engine is None or not engine.accepting:
            raise NotReady("the server is not ready (loading, compiling or shutting down)")
        return engine

    async def prepare(engine: Any, req: CompletionRequest | ChatCompletionRequest, chat: bool, n: int,
                      tools: tool_calls.ToolRequest | None = None) -> tuple[list[list[int]], list[str | None]]:
        """Token ids (and text) of every prompt, computed in a worker thread."""
        e = engine.engine
        tokenizer = e.tokenizer
        limit_chars = e.max_model_len * max_token_chars(tokenizer)
        if chat:
            messages = [m.for_template() for m in req.messages]
            total = sum(len(m["content"]) for m in messages)
            if total > limit_chars:  # cannot fit the context, whatever it tokenizes to: skip the work
                raise InvalidRequest(f"messages hold {total} characters, more than a {e.max_model_len}-token "
                                     "context can hold", "messages")

            def render() -> list[int]:
                msgs, extra = tool_calls.template_inputs(tokenizer, messages, tools, tool_call_parser)
                return render_chat(tokenizer, msgs, extra)

            ids = await asyncio.to_thread(render)
            return [ids], [None]
        prompts = req.prompt  # (a list of prompts once parsed)
        check_sequences(len(prompts), n, max_sequences_per_request)
        texts: list[str | None] = []
        for p in prompts:
            if isinstance(p, str):
                check_text_size(p, max_request_bytes, "prompt")
                if len(p) > limit_chars:
                    raise InvalidRequest(f"prompt is {len(p)} characters, more than a {e.max_model_len}-token "
                                         "context can hold", "prompt")
                texts.append(p)
            else:
                vocab = e.model_config.vocab_size
                bad = next((t for t in p if not 0 <= t < vocab), None)
                if bad is not None:
                    raise InvalidRequest(f"prompt token ids must be in [0, {vocab}), got {bad}", "prompt")
                texts.append(None)
        strs = [p for p in prompts if isinstance(p, str)]

        def encode() -> list[list[int]]:
            return [list(tokenizer(s, add_special_tokens=True).input_ids) for s in strs]

        encoded = iter(await asyncio.to_thread(encode)) if strs else iter(())
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts], texts

    def fit_max_tokens(engine: Any, params: Any, prompt_ids: list[list[int]]) -> Any:
        """Chat without max_tokens: the rest of the context (and of the page pool)."""
        if params.max_tokens is not None:
            return params
        e = engine.engine
        capacity = (e.num_pages - 1) * e.pool.page_size
        longest = max(len(ids) for ids in prompt_ids)
        if longest >= e.max_model_len:
            raise InvalidRequest(f"prompt is {longest} tokens, the context length is {e.max_model_len}", "messages")
        params.max_tokens = max(1, min(e.max_model_len, capacity) - longest)
        return params

    def logprobs_json(comp: Completion, tokenizer: Any, chat: bool) -> Any:
        if not comp.logprobs:
            return None
        if chat:
            content = []
            for tok, entry in zip(comp.token_ids, comp.logprobs):
                content.append({"token": tokenizer.decode([tok]), "logprob": entry[tok],
                                "bytes": list(tokenizer.decode([tok]).encode("utf-8")),
                                "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": lp,
                                                  "bytes": list(tokenizer.decode([t]).encode("utf-8"))}
                                                 for t, lp in entry.items()]})
            return {"content": content}
        return {"tokens": [tokenizer.decode([t]) for t in comp.token_ids],
                "token_logprobs": [e[t] for t, e in zip(comp.token_ids, comp.logprobs)],
                "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e.items()} for e in comp.logprobs]}

    async def run_all(engine, prompts, texts, params, labels: list[str], priority: int = 0):
        """Non-streaming: run every prompt to the end (the caller aborts on disconnect)."""
        results: dict[tuple[int, int], Completion] = {}
        prompt_logprobs: dict[int, Any] = {}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}

        async def one(pi: int, prompt: Any):
            async for out in stream_outputs(engine, metrics, prompt, params, request_id=labels[pi],
                                            priority=priority, prompt_text=texts[pi]):
                comp = out.outputs[0]
                if out.prompt_logprobs is not None:
                    prompt_logprobs[pi] = out.prompt_logprobs
                if out.finished:
                    results[(pi, comp.index)] = Completion(comp.text, list(comp.token_ids), comp.logprobs or [],
                                                           comp.finish_reason)
                    usage["completion_tokens"] += len(comp.token_ids)
                    if comp.index == 0:
                        usage["prompt_tokens"] += len(out.prompt_token_ids)
                        usage["cached"] += out.num_cached_tokens

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # one failed or we were cancelled: stop the rest (their pages are freed)
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return results, usage, prompt_logprobs

    def usage_json(u: dict[str, int]) -> dict[str, Any]:
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached"]}}

    async def handle(request: Request, chat: bool) -> Response:
        try:
            client_id = fleet.request_id_from(request.headers)
            body = await body_of(request)
            req = parse_request(body, chat)
            fields = dict(req)  # (tools and structured outputs: validated by their own modules)
            tools = tool_calls.tools_from_body(fields, chat)
            engine = engine_or_raise()
            priority = priority_of(req, engine)
            params = sampling(req, chat)
            if tools is not None and tools.forced:
                params.structured_outputs = tools.constraint()
            n_out, keep_logprobs = params.n, params.logprobs is not None
            best_of = None if chat else req.best_of
            if best_of is not None and best_of > params.n:
                # vLLM's best_of: generate best_of candidates, answer with the n of highest
                # cumulative logprob; each candidate's token logprobs are needed to rank it.
                params.n = best_of
                if params.logprobs is None:
                    params.logprobs = 0
            check_for_model(params, engine)
            await compile_grammar(engine, fields, params)
            if chat:
                check_sequences(1, params.n, max_sequences_per_request)
            disconnected, prepared = await _until_disconnect(request, prepare(engine, req, chat, params.n, tools))
            if disconnected:
                return Response(status_code=499)
            prompts, texts = prepared
            params = fit_max_tokens(engine, params, prompts)
            # vLLM's ids: the client's X-Request-Id names the response; it is the requests' label
            # in the engine (exactly, for one prompt; with -<i> per prompt), which keeps its own ids.
            rid = ("chatcmpl-" if chat else "cmpl-") + (client_id or uuid.uuid4().hex[:24])
            if client_id is None:
                labels = [f"{rid}-p{i}" for i in range(len(prompts))]
            else:
                labels = [client_id] if len(prompts) == 1 else [f"{client_id}-{i}" for i in range(len(prompts))]
            id_header = {fleet.REQUEST_ID_HEADER: client_id or rid}
            created = int(time.time())
            obj = "chat.completion" if chat else "text_completion"
            want_ids = bool(req.return_token_ids)
            if req.stream:
                opts = req.stream_options
                include_usage = bool(opts and opts.include_usage)
                # vLLM's extension (guidellm sends it): every chunk carries the usage so far.
                continuous = include_usage and bool(opts.continuous_usage_stats)
                stream = stream_response(engine, prompts, texts, params, rid, labels, created, chat, include_usage,
                                         want_ids, continuous, tools, priority)
                # Admission errors surface as a 400/429, not mid-stream; a client gone meanwhile aborts it.
                disconnected, first = await _until_disconnect(request, stream.__anext__())
                if disconnected:
                    await stream.aclose()
                    return Response(status_code=499)
                return StreamingResponse(_prepend(first, stream), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **id_header})
            work = run_all(engine, prompts, texts, params, labels, priority)
            disconnected, ran = await _until_disconnect(request, work)
            if disconnected:  # nobody to answer; the requests were aborted and their pages freed
                return Response(status_code=499)
            results, usage, prompt_logprobs = ran
            if params.n != n_out:  # (usage still counts every candidate's tokens, as OpenAI bills them)
                results = best_of_choices(results, n_out, keep_logprobs)
            tok = engine.engine.tokenizer
            choices = []
            for (pi, ci), comp in sorted(results.items()):
                index = pi * n_out + ci
                choice: dict[str, Any] = {"index": index}
                finish_reason = comp.finish_reason
                if chat and tools is not None:
                    choice["message"], finish_reason = tool_calls.parse_message(tools, comp.text, finish_reason)
                    choice["logprobs"] = logprobs_json(comp, tok, chat)
                elif chat:
                    choice["message"] = {"role": "assistant", "content": comp.text}
                    choice["logprobs"] = logprobs_json(comp, tok, chat)
                elif req.echo:
                    choice.update(echo_choice(comp, prompts[pi], texts[pi], prompt_logprobs.get(pi),
                                              keep_logprobs, tok))
                else:
                    choice["text"] = comp.text
                    choice["logprobs"] = logprobs_json(comp, tok, chat)
                choice["finish_reason"] = finish_reason
                if want_ids:
                    choice["token_ids"] = comp.token_ids
                choices.append(choice)
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                                 "system_fingerprint": system_fingerprint(engine), "choices": choices,
                                 "usage": usage_json(usage)}, headers=id_header)
        except (InvalidRequest, NotFound, Overloaded, NotReady, EngineFailure) as exc:
            return error_response(exc)
        except Exception as exc:  # noqa: BLE001 - this request alone fails, in OpenAI's shape
            logging.getLogger(__name__).exception("request failed")
            return error_response(exc)

    async def stream_response(engine, prompts, texts, params, rid, labels, created, chat, include_usage,
                              want_ids, continuous: bool = False,
                              tools: tool_calls.ToolRequest | None = None, priority: int = 0) -> AsyncIterator[str]:
        """SSE chunks. Every engine output with new tokens is sent, even when its text is held
        back (a possible stop string, an incomplete character): its token ids and logprobs count.
        `continuous`: each chunk's usage is the request's so far (prompts seen, tokens generated)."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
        tok = engine.engine.tokenizer
        fingerprint = system_fingerprint(engine)
        tool_streams: dict[int, tool_calls.ToolStream] = {}  # per choice: calls held back until complete
        prompt_lens: dict[int, int] = {}  # for continuous usage: per prompt, and tokens per choice so far
        produced: dict[tuple[int, int], int] = {}

        def usage_so_far() -> Any:
            if not continuous:
                return None
            return usage_json({"prompt_tokens": sum(prompt_lens.values()), "completion_tokens": sum(produced.values()),
                               "cached": 0})

        async def one(pi: int, prompt: Any):
            try:
                async for out in stream_outputs(engine, metrics, prompt, params, request_id=labels[pi],
                                                priority=priority, prompt_text=texts[pi]):
                    await queue.put((pi, out))
                await queue.put((pi, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((pi, exc))

        def chunk(choices: list[dict[str, Any]], usage_value: Any = None) -> str:
            c: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model_name,
                                 "system_fingerprint": fingerprint, "choices": choices}
            if include_usage:
                c["usage"] = usage_value
            return f"data: {json.dumps(c)}\n\n"

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        done = 0
        sent = False  # nothing sent yet: an error is still the handler's 400/429/503
        try:
            while done < len(tasks):
                pi, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    if not sent:
                        raise item
                    yield error_event(item)
                    yield "data: [DONE]\n\n"
                    return
                comp = item.outputs[0]
                prompt_lens.setdefault(pi, len(item.prompt_token_ids))
                produced[(pi, comp.index)] = produced.get((pi, comp.index), 0) + len(item.delta_token_ids)
                if chat and not sent:  # OpenAI's first chunk: every choice's role, before any content
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for i in range(len(prompts) * params.n)], usage_so_far())
                sent = True
                index = pi * params.n + comp.index
                if item.finished:
                    usage["completion_tokens"] += len(comp.token_ids)
                    if comp.index == 0:
                        usage["prompt_tokens"] += len(item.prompt_token_ids)
                        usage["cached"] += item.num_cached_tokens
                if not item.delta_text and not item.delta_token_ids and not item.finished:
                    continue
                finish_reason = comp.finish_reason if item.finished else None
                if chat and tools is not None:
                    ts = tool_streams.setdefault(index, tool_calls.ToolStream(tools))
                    text, call_deltas, finish_reason = ts.step(item.delta_text, item.finished, finish_reason)
                    choice: dict[str, Any] = {"index": index, "delta": {"content": text}}
                    if call_deltas:
                        choice["delta"]["tool_calls"] = call_deltas
                elif chat:
                    choice = {"index": index, "delta": {"content": item.delta_text}}
                else:
                    choice = {"index": index, "text": item.delta_text}
                choice["logprobs"] = None
                if item.delta_logprobs and item.delta_token_ids:
                    part = Completion(token_ids=item.delta_token_ids, logprobs=item.delta_logprobs)
                    choice["logprobs"] = logprobs_json(part, tok, chat)
                choice["finish_reason"] = finish_reason
                if want_ids:
                    choice["token_ids"] = list(item.delta_token_ids)
                yield chunk([choice], usage_so_far())
            if include_usage:
                yield chunk([], usage_json(usage))
            yield "data: [DONE]\n\n"
        finally:  # the client left (or we are done): abort whatever still runs
            for t in tasks:
                if not t.done():
                    t.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    # OpenAI's Responses API, translated onto the chat route's pieces (server/responses_api.py).
    app.add_api_route("/v1/responses", responses_api.endpoint(responses_api.ChatPath(
        body_of, parse_request, engine_or_raise, sampling, compile_grammar, prepare, fit_max_tokens, run_all, _until_disconnect,
        error_response, metrics, model_name)), methods=["POST"])

    def model_card() -> dict[str, Any]:
        engine = get_engine()
        card: dict[str, Any] = {"id": model_name, "object": "model", "created": 0, "owned_by": "jaxserve"}
        if engine is not None:
            card["max_model_len"] = engine.engine.max_model_len
        return card

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> Response:
        if model_id != model_name:
            return error(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                         param="model", code="model_not_found")
        return JSONResponse(model_card())

    @app.get("/health")
    async def health() -> Response:
        engine = get_engine()
        ok = engine is not None and engine.accepting
        status = "ok" if ok else ("loading" if engine is None else "draining")
        return JSONResponse({"status": status}, status_code=200 if ok else 503,
                            headers=None if ok else {"Retry-After": RETRY_AFTER_503})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(get_engine()), media_type="text/plain; version=0.0.4")

    # ---- what routers and orchestrators call (docs/fleet.md) ----------------------------------
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness probe: the same answer as /health."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": fleet.server_version()}

    def about(build: Callable[..., Any]) -> Callable[[], Awaitable[Response]]:
        """An engine-backed info endpoint: 503 until the model is loaded."""
        async def endpoint() -> Response:
            engine = get_engine()
            if engine is None:
                return error_response(NotReady("the server is not ready (loading the model)"))
            return JSONResponse(build(engine, model_name))
        return endpoint

    # SGLang's names; the get_ forms are its older ones, which sglang-router still falls back to.
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, about(fleet.model_info), methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, about(fleet.server_info), methods=["GET"])
    app.add_api_route("/get_load", about(lambda engine, _name: fleet.load(engine)), methods=["GET"])

    if debug_endpoints:
        @app.get("/debug/pages")
        async def pages() -> Response:
            """Tests: page-pool invariants (checked between steps) and page counts."""
            engine = get_engine()
            if engine is None:
                return error(503, "not ready", "service_unavailable")
            try:
                return JSONResponse(await asyncio.to_thread(engine.check_invariants))
            except AssertionError as exc:
                return error(500, f"invariant violated: {exc}", "server_error")

    return app


def echo_choice(comp: Completion, prompt_ids: list[int], prompt_text: str | None,
                prompt_logprobs: list | None, want_logprobs: bool, tokenizer: Any) -> dict[str, Any]:
    """OpenAI's legacy echo: the prompt before the completion, in the text and the logprobs
    (the first prompt token has no logprob: null), with each token's character offset."""
    head = prompt_text if prompt_text is not None else tokenizer.decode(prompt_ids)
    out: dict[str, Any] = {"text": head + comp.text, "logprobs": None}
    if not want_logprobs:
        return out
    ids = list(prompt_ids) + list(comp.token_ids)
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    entries = list(prompt_logprobs or [None] * len(prompt_ids)) + list(comp.logprobs)
    out["logprobs"] = {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.get(t) for t, e in zip(ids, entries)],
        "top_logprobs": [None if e is None else {tokenizer.decode([k]): lp for k, lp in e.items()}
                         for e in entries],
        "text_offset": offsets,
    }
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> list[int]:
    """The chat template's prompt ids. A message `name` is the template's to render; one whose
    template renders the same prompt without the names would be silently dropped, so it is
    refused instead (400 naming the first named message)."""
    def ids_of(msgs: list[dict[str, Any]]) -> list[int]:
        try:
            ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **(extra or {}))
        except Exception as exc:  # noqa: BLE001 - the template refused these messages
            raise InvalidRequest(f"messages: the chat template failed: {exc}", "messages") from None
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    ids = ids_of(messages)
    named = [i for i, m in enumerate(messages) if m.get("name") is not None]
    if named and ids_of([{k: v for k, v in m.items() if k != "name"} for m in messages]) == ids:
        where = f"messages[{named[0]}].name"
        raise InvalidRequest(f"{where}: this model's chat template does not use message names (the prompt "
                             "would be the same without them); send the messages without `name`", where)
    return ids


def best_of_choices(results: dict[tuple[int, int], Completion], n: int,
                    keep_logprobs: bool) -> dict[tuple[int, int], Completion]:
    """best_of: per prompt, the n candidates of highest cumulative logprob (the sum of their
    sampled tokens' logprobs under the model's distribution), best first; ties by candidate index.
    Their logprobs are dropped unless the client asked for them."""
    by_prompt: dict[int, list[tuple[int, Completion]]] = {}
    for (pi, ci), comp in results.items():
        by_prompt.setdefault(pi, []).append((ci, comp))
    out = {}
    for pi, candidates in by_prompt.items():
        ranked = sorted(candidates, key=lambda c: (-cumulative_logprob(c[1]), c[0]))
        for rank, (_, comp) in enumerate(ranked[:n]):
            if not keep_logprobs:
                comp.logprobs = []
            out[(pi, rank)] = comp
    return out


def cumulative_logprob(comp: Completion) -> float:
    return sum(entry[tok] for tok, entry in zip(comp.token_ids, comp.logprobs))


def _check_strings(value: Any, name: str) -> None:
    """Every string in the body must be encodable (JSON's "\\ud800" decodes to an unpaired surrogate)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(f"{name} holds an unpaired surrogate, which is not valid Unicode", name) from None
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(v.keys())


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item
