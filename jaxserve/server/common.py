"""What both front ends share: building SamplingParams from a request, and one streamed request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.engine.engine import QueueFullError, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.metrics import Metrics, RequestTimer

SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logprobs", "n")


class InvalidRequest(ValueError):
    """A client error: gRPC INVALID_ARGUMENT, HTTP 400. The message names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Overloaded(RuntimeError):
    """The waiting queue is full: gRPC RESOURCE_EXHAUSTED, HTTP 429."""


class NotReady(RuntimeError):
    """Still loading or compiling, or shutting down: gRPC UNAVAILABLE, HTTP 503."""


def field_of(message: str) -> str | None:
    for name in SAMPLING_FIELDS + ("prompt", "messages", "model", "request_id"):
        if message.startswith(name) or f" {name} " in message:
            return name
    return None


def make_sampling_params(values: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(str(exc), field_of(str(exc))) from None


@dataclass
class Completion:
    """Accumulated state of one of the n completions of a request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


async def stream_outputs(
    engine: AsyncEngine | None, metrics: Metrics, prompt: str | Sequence[int], params: SamplingParams,
    request_id: str | None = None, priority: int = 0,
) -> AsyncIterator[RequestOutput]:
    """Run one request, translating engine errors into client errors and recording metrics."""
    if engine is None or not engine.accepting:
        raise NotReady("the server is not ready (loading, compiling or shutting down)")
    timer = RequestTimer(metrics)
    done: dict[int, RequestOutput] = {}
    try:
        async for out in engine.generate(prompt, params, request_id=request_id, priority=priority):
            timer.on_scheduled(out.queue_seconds)
            timer.on_tokens(len(out.delta_token_ids))
            if out.finished:
                done[out.outputs[0].index] = out
            yield out
    except QueueFullError as exc:
        raise Overloaded(str(exc)) from None
    except EngineDeadError as exc:  # shutting down, or stopped by a fatal error
        raise NotReady(str(exc)) from None
    except ValueError as exc:
        raise InvalidRequest(str(exc), field_of(str(exc))) from None
    finally:
        first = next(iter(done.values()), None)
        reason = first.outputs[0].finish_reason if first and len(done) == params.n else "abort"
        timer.on_finish(reason, len(first.prompt_token_ids) if first else 0)
