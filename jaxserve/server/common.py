"""What both front ends share: building SamplingParams from a request, and one streamed request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.engine.engine import QueueFullError, RequestOutput, check_logit_bias_vocab
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.metrics import Metrics, RequestTimer

SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logprobs", "prompt_logprobs", "n")


class InvalidRequest(ValueError):
    """A client error: gRPC INVALID_ARGUMENT, HTTP 400. The message names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Overloaded(RuntimeError):
    """The waiting queue is full: gRPC RESOURCE_EXHAUSTED, HTTP 429 (with Retry-After)."""


class NotReady(RuntimeError):
    """Still loading or compiling, or shutting down: gRPC UNAVAILABLE, HTTP 503 (with Retry-After)."""


class EngineFailure(RuntimeError):
    """The engine failed this request (a failed step, or its inputs alone): gRPC INTERNAL, HTTP 500."""


class NotFound(LookupError):
    """An unknown model: HTTP 404 model_not_found (gRPC has no model field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def field_of(message: str) -> str | None:
    if message.startswith("prompt_token_ids"):
        return "prompt"
    for name in SAMPLING_FIELDS + ("logit_bias", "prompt", "messages", "model", "request_id"):
        if message.startswith(name + " ") or message.startswith(name + ":") or f" {name} " in message:
            return name
    return None


def make_sampling_params(values: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidRequest(str(exc), field_of(str(exc))) from None


def check_for_model(params: SamplingParams, engine: AsyncEngine) -> None:
    """Ranges only the served model knows: token ids must be in its vocabulary."""
    vocab = engine.engine.model_config.vocab_size
    bad = next((t for t in params.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(f"stop_token_ids must be in [0, {vocab}), got {bad}", "stop_token_ids")
    try:
        check_logit_bias_vocab(params, vocab)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "logit_bias") from None


def check_sequences(num_prompts: int, n: int, limit: int) -> None:
    """One request may not fill the waiting queue on its own: prompts x n is capped."""
    if num_prompts * n > limit:
        raise InvalidRequest(f"n: {num_prompts} prompts x n={n} = {num_prompts * n} sequences, the limit per "
                             f"request is {limit} (prompts x n)", "n")


async def tokenize(engine: AsyncEngine, text: str, max_bytes: int, name: str = "prompt") -> list[int]:
    """Tokenize off the event loop and outside the engine lock; refuse by size first: a text
    longer than the context times the longest token cannot fit, whatever it tokenizes to."""
    check_text_size(text, max_bytes, name)
    e = engine.engine
    if len(text) > e.max_model_len * max_token_chars(e.tokenizer):
        raise InvalidRequest(f"{name} is {len(text)} characters, more than a {e.max_model_len}-token context "
                             "can hold", name)
    tokenizer = e.tokenizer
    return await asyncio.to_thread(lambda: list(tokenizer(text, add_special_tokens=True).input_ids))


def check_text_size(text: str, max_bytes: int, name: str) -> None:
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # an unpaired surrogate (JSON "\ud800")
        raise InvalidRequest(f"{name} is not valid Unicode (an unpaired surrogate)", name) from None
    if size > max_bytes:
        raise InvalidRequest(f"{name} is {size} bytes, the limit is {max_bytes}", name)


_TOKEN_CHARS: dict[int, int] = {}


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token decodes to: a text longer than context x this cannot fit."""
    key = id(tokenizer)
    if key not in _TOKEN_CHARS:
        try:
            vocab = tokenizer.get_vocab()
            _TOKEN_CHARS[key] = max(8, max(len(t) for t in vocab)) if vocab else 64
        except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: a loose bound
            _TOKEN_CHARS[key] = 64
    return _TOKEN_CHARS[key]


@dataclass
class Completion:
    """Accumulated state of one of the n completions of a request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


async def stream_outputs(
    engine: AsyncEngine | None, metrics: Metrics, prompt: str | Sequence[int], params: SamplingParams,
    request_id: str | None = None, priority: int = 0, prompt_text: str | None = None,
) -> AsyncIterator[RequestOutput]:
    """Run one request, translating engine errors into client errors and recording metrics.
    Requests refused at admission (400, 429, 503) are not counted as finished requests. Outputs
    before the final one carry only their deltas (delta_text, delta_token_ids, delta_logprobs)."""
    if engine is None or not engine.accepting:
        raise NotReady("the server is not ready (loading, compiling or shutting down)")
    timer = RequestTimer(metrics)
    done: dict[int, RequestOutput] = {}
    refused = False  # at admission: not a finished request, not a latency
    try:
        async for out in engine.generate(prompt, params, request_id=request_id, priority=priority,
                                         prompt_text=prompt_text, cumulative=False):
            if out.error is not None:
                raise EngineFailure(f"the engine failed this request: {out.error}")
            timer.on_scheduled(out.queue_seconds)
            timer.on_tokens(len(out.delta_token_ids))
            if out.finished:
                done[out.outputs[0].index] = out
            yield out
    except QueueFullError as exc:
        refused = True
        raise Overloaded(str(exc)) from None
    except EngineDeadError as exc:  # shutting down, or stopped by a fatal error: a final error
        raise NotReady(str(exc)) from None
    except (ValueError, TypeError, OverflowError) as exc:  # raised by admission: the request's values
        refused = True
        raise InvalidRequest(str(exc), field_of(str(exc))) from None
    except RuntimeError as exc:  # a failed engine step (the loop reports it to every request in it)
        if isinstance(exc, (EngineFailure, NotReady, Overloaded)):
            raise
        raise EngineFailure(str(exc)) from None
    finally:
        if not refused:
            first = next(iter(done.values()), None)
            reason = first.outputs[0].finish_reason if first and len(done) == params.n else "abort"
            timer.on_finish(reason, len(first.prompt_token_ids) if first else 0)
