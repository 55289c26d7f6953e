"""OpenAI-compatible HTTP front end (FastAPI): completions, chat completions, models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxserve.server.common import (Completion, InvalidRequest, NotReady, Overloaded, make_sampling_params,
                                    stream_outputs)
from jaxserve.server.metrics import Metrics

# OpenAI name -> SamplingParams name, plus vLLM's extra sampling fields.
_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "n")


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def build_http_app(get_engine: Callable[[], Any], metrics: Metrics, model_name: str, api_key: str | None = None,
                   max_request_bytes: int = 1 << 20) -> FastAPI:
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error(401, "missing or wrong API key", "authentication_error")
        return await call_next(request)

    async def body_of(request: Request) -> dict[str, Any]:
        chunks, size = [], 0
        async for chunk in request.stream():  # read on past the limit without keeping it, so the
            size += len(chunk)                 # client gets our 400 rather than a reset connection
            if size <= max_request_bytes:
                chunks.append(chunk)
        if size > max_request_bytes:
            raise InvalidRequest(f"request body is {size} bytes, the limit is {max_request_bytes}")
        raw = b"".join(chunks)
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidRequest("request body is not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise InvalidRequest(f"model {model!r} does not exist; this server serves {model_name!r}", "model")
        return body

    def sampling(body: dict[str, Any], chat: bool) -> Any:
        values = {k: body.get(k) for k in _FIELDS}
        if chat:
            values["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
            if body.get("logprobs"):
                values["logprobs"] = body.get("top_logprobs") or 0
        else:
            values["logprobs"] = body.get("logprobs")
        if values.get("max_tokens") is None and not chat:
            values["max_tokens"] = 16  # OpenAI's completions default
        return make_sampling_params(values)

    def engine_or_raise() -> Any:
        engine = get_engine()
        if engine is None or not engine.accepting:
            raise NotReady("the server is not ready (loading, compiling or shutting down)")
        return engine

    def chat_prompt(engine: Any, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequest("messages: each message needs a string role and content", "messages")
        ids = engine.engine.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    def completion_prompts(body: dict[str, Any]) -> list[Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return prompt
        raise InvalidRequest("prompt must be a non-empty string, list of strings or list of token ids", "prompt")

    def logprobs_json(comp: Completion, tokenizer: Any, chat: bool) -> Any:
        if not comp.logprobs:
            return None
        if chat:
            content = []
            for tok, entry in zip(comp.token_ids, comp.logprobs):
                content.append({"token": tokenizer.decode([tok]), "logprob": entry[tok],
                                "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": lp}
                                                 for t, lp in entry.items()]})
            return {"content": content}
        return {"tokens": [tokenizer.decode([t]) for t in comp.token_ids],
                "token_logprobs": [e[t] for t, e in zip(comp.token_ids, comp.logprobs)],
                "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e.items()} for e in comp.logprobs]}

    async def run_all(engine, prompts, params, request: Request, rid: str):
        """Non-streaming: run every prompt, abort all if the client goes away."""
        results: dict[tuple[int, int], Completion] = {}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}

        async def one(pi: int, prompt: Any):
            async for out in stream_outputs(engine, metrics, prompt, params, request_id=f"{rid}-p{pi}"):
                comp = out.outputs[0]
                if out.finished:
                    results[(pi, comp.index)] = Completion(comp.text, comp.token_ids, comp.logprobs or [],
                                                           comp.finish_reason)
                    usage["completion_tokens"] += len(comp.token_ids)
                    if comp.index == 0:
                        usage["prompt_tokens"] += len(out.prompt_token_ids)
                        usage["cached"] += out.num_cached_tokens

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        try:
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
                if any(t.done() and t.exception() for t in tasks):
                    break
                if await request.is_disconnected():
                    break
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception():
                raise t.exception()
        return results, usage

    def usage_json(u: dict[str, int]) -> dict[str, Any]:
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached"]}}

    async def handle(request: Request, chat: bool) -> Response:
        try:
            body = await body_of(request)
            engine = engine_or_raise()
            params = sampling(body, chat)
            prompts = [chat_prompt(engine, body.get("messages"))] if chat else completion_prompts(body)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            created = int(time.time())
            obj = "chat.completion" if chat else "text_completion"
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                stream = stream_response(engine, prompts, params, rid, created, chat, include_usage)
                first = await stream.__anext__()  # surface validation errors as a 400, not mid-stream
                return StreamingResponse(_prepend(first, stream), media_type="text/event-stream")
            results, usage = await run_all(engine, prompts, params, request, rid)
            tok = engine.engine.tokenizer
            choices = []
            for (pi, ci), comp in sorted(results.items()):
                index = pi * params.n + ci
                choice: dict[str, Any] = {"index": index, "finish_reason": comp.finish_reason,
                                          "logprobs": logprobs_json(comp, tok, chat)}
                if chat:
                    choice["message"] = {"role": "assistant", "content": comp.text}
                else:
                    choice["text"] = comp.text
                choices.append(choice)
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                                 "choices": choices, "usage": usage_json(usage)})
        except InvalidRequest as exc:
            return error(400, str(exc), param=exc.param)
        except Overloaded as exc:
            return error(429, str(exc), "rate_limit_error")
        except NotReady as exc:
            return error(503, str(exc), "service_unavailable")
        except Exception as exc:  # noqa: BLE001 - this request alone fails, in OpenAI's shape
            return error(500, f"internal error: {exc}", "server_error")

    async def stream_response(engine, prompts, params, rid, created, chat, include_usage) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
        tok = engine.engine.tokenizer

        async def one(pi: int, prompt: Any):
            try:
                async for out in stream_outputs(engine, metrics, prompt, params, request_id=f"{rid}-p{pi}"):
                    await queue.put((pi, out))
                await queue.put((pi, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((pi, exc))

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        done = 0
        first = True
        try:
            while done < len(tasks):
                pi, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                comp = item.outputs[0]
                index = pi * params.n + comp.index
                if item.finished:
                    usage["completion_tokens"] += len(comp.token_ids)
                    if comp.index == 0:
                        usage["prompt_tokens"] += len(item.prompt_token_ids)
                        usage["cached"] += item.num_cached_tokens
                if not item.delta_text and not item.finished and not first:
                    continue
                if chat:
                    delta: dict[str, Any] = {"content": item.delta_text}
                    if first:
                        delta["role"] = "assistant"
                    choice: dict[str, Any] = {"index": index, "delta": delta}
                else:
                    choice = {"index": index, "text": item.delta_text}
                choice["finish_reason"] = comp.finish_reason if item.finished else None
                if comp.logprobs and item.delta_token_ids:
                    n_new = len(item.delta_token_ids)
                    part = Completion(token_ids=item.delta_token_ids, logprobs=comp.logprobs[-n_new:])
                    choice["logprobs"] = logprobs_json(part, tok, chat)
                first = False
                chunk = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                chunk = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                         "usage": usage_json(usage)}
                yield f"data: {json.dumps(chunk)}\n\n"
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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jaxserve"}]}

    @app.get("/health")
    async def health() -> Response:
        engine = get_engine()
        ok = engine is not None and engine.accepting
        return JSONResponse({"status": "ok" if ok else "loading"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(get_engine()), media_type="text/plain; version=0.0.4")

    return app


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item
