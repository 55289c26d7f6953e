"""gRPC front end (grpc.aio): jaxserve.v1.Generation/Generate, health and reflection.

The method is registered with a raw-bytes deserializer so that a request protobuf cannot parse
(invalid UTF-8 in `text`, say) is answered INVALID_ARGUMENT by us, not INTERNAL by grpc.

The proto is a fixed contract, so what it has no field for travels in the call's metadata: the
key `jaxserve-sampling` holds a JSON object of the HTTP routes' names, read by the same code:
the sampling fields the proto lacks (`logit_bias`, `skip_special_tokens`,
`num_speculative_tokens`) and structured output (`structured_outputs`, `response_format` or a
`guided_*` field). A field set in both places, or one neither knows, is INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError
from pydantic import StrictInt, ValidationError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.common import (EngineFailure, InvalidRequest, NotReady, Overloaded, check_for_model,
                                    stream_outputs, tokenize)
from jaxserve.server.metrics import Metrics
from jaxserve.server.openai_models import SamplingFields, invalid_request, sampling_params
from jaxserve.server.structured_fields import FIELDS as STRUCTURED_FIELDS
from jaxserve.server.structured_fields import structured_outputs_from_body

log = logging.getLogger(__name__)
access_log = logging.getLogger("jaxserve.access")
SERVICE = "jaxserve.v1.Generation"
EXTRA_KEY = "jaxserve-sampling"  # metadata: a JSON object of the fields the proto has no place for


class GrpcSampling(SamplingFields):
    """The proto's SamplingParams: the fields the HTTP routes share (openai_models.SamplingFields,
    the one source), plus logprobs as an int (as on completions)."""

    logprobs: StrictInt | None = None


def extra_fields(metadata: Any) -> dict[str, Any]:
    """The `jaxserve-sampling` metadata entry as a dict ({} without one)."""
    raw = [v for k, v in (metadata or ()) if k == EXTRA_KEY]
    if not raw:
        return {}
    if len(raw) > 1:
        raise InvalidRequest(f"{EXTRA_KEY} is given {len(raw)} times", EXTRA_KEY)
    try:
        value = json.loads(raw[0])
    except ValueError as exc:
        raise InvalidRequest(f"{EXTRA_KEY} must be a JSON object: {exc}", EXTRA_KEY) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{EXTRA_KEY} must be a JSON object, got {type(value).__name__}", EXTRA_KEY)
    return value


def sampling_from_proto(msg: pb.GenerateRequest, extra: dict[str, Any] | None = None) -> SamplingParams:
    """SamplingParams of the request's set fields, read by the shared model's names, plus the
    metadata's `extra` fields (extra_fields)."""
    s = msg.sampling
    values: dict[str, Any] = {}
    for name, field in s.DESCRIPTOR.fields_by_name.items():
        if field.is_repeated:  # (no presence: empty means unset)
            if getattr(s, name):
                values[name] = list(getattr(s, name))
        elif s.HasField(name):
            values[name] = getattr(s, name)
    extra = dict(extra or {})
    structured = {k: extra.pop(k) for k in list(extra) if k in STRUCTURED_FIELDS}
    for name in extra:
        if name in s.DESCRIPTOR.fields_by_name:
            raise InvalidRequest(f"{EXTRA_KEY}.{name}: the proto has this field; set it there", f"{EXTRA_KEY}.{name}")
    try:
        try:
            fields = GrpcSampling.model_validate({**values, **extra})
        except ValidationError as exc:
            raise invalid_request(exc) from None
        params = sampling_params(fields, logprobs=fields.logprobs)
        params.structured_outputs, _ = structured_outputs_from_body(structured)
    except InvalidRequest as exc:
        root = (exc.param or "").split(".")[0].split("[")[0]
        if root in extra or root in structured:  # named where the client put it
            raise InvalidRequest(f"{EXTRA_KEY}: {exc}", f"{EXTRA_KEY}.{exc.param}") from None
        raise
    return params


class GenerationService:
    def __init__(self, get_engine: Callable[[], Any], metrics: Metrics, api_key: str | None,
                 max_request_bytes: int):
        self.get_engine = get_engine
        self.metrics = metrics
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext):
        """One access-log line per call: peer, status, messages sent, time."""
        # The peer is read now: grpc.aio's context.peer() crashes the process (SIGSEGV, seen with
        # grpcio 1.85) once a cancelled call is torn down.
        start, sent, peer = time.monotonic(), 0, context.peer()
        ctx = _RecordingContext(context)
        try:
            async for msg in self._generate(raw, ctx):
                sent += 1
                yield msg
        except asyncio.CancelledError:
            ctx.status = "CANCELLED"
            raise
        except BaseException:
            ctx.status = ctx.status if ctx.status != "OK" else "ERROR"
            raise
        finally:
            access_log.info('%s "gRPC Generate" %s %d messages %.1f ms', peer, ctx.status, sent,
                            (time.monotonic() - start) * 1000)

    async def _generate(self, raw: bytes, context: grpc.aio.ServicerContext):
        if self.api_key is not None:
            md = dict(context.invocation_metadata() or ())
            given = md.get("authorization", "").removeprefix("Bearer ").strip() or md.get("x-api-key")
            if given != self.api_key:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        if len(raw) > self.max_request_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request is {len(raw)} bytes, the limit is {self.max_request_bytes}")
        try:
            req = pb.GenerateRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"text: request does not parse ({exc}); "
                                "strings must be valid UTF-8")
        try:
            kind = req.WhichOneof("prompt")
            if kind is None:
                raise InvalidRequest("prompt is missing: set text or token_ids", "prompt")
            prompt = req.text if kind == "text" else list(req.token_ids.ids)
            if not prompt:
                raise InvalidRequest(f"prompt ({kind}) must not be empty", "prompt")
            params = sampling_from_proto(req, extra_fields(context.invocation_metadata()))
            engine = self.get_engine()
            if engine is None or not engine.accepting:
                raise NotReady("the server is not ready (loading, compiling or shutting down)")
            check_for_model(params, engine)
            if params.structured_outputs is not None:  # compiled off the loop, cached for the engine
                try:
                    await asyncio.to_thread(engine.engine.grammars.compile, params.structured_outputs)
                except ValueError as exc:
                    raise InvalidRequest(f"{EXTRA_KEY}: {exc}", EXTRA_KEY) from None
            text = None
            if kind == "text":  # tokenized in a worker thread: neither the loop nor the engine lock waits
                text, prompt = prompt, await tokenize(engine, prompt, self.max_request_bytes)
            async for out in stream_outputs(engine, self.metrics, prompt, params, request_id=req.request_id or None,
                                            priority=req.priority, prompt_text=text):
                comp = out.outputs[0]
                msg = pb.GenerateResponse(request_id=out.request_id, index=comp.index, text=out.delta_text,
                                          token_ids=out.delta_token_ids)
                if out.delta_logprobs:
                    for tok, entry in zip(out.delta_token_ids, out.delta_logprobs):
                        msg.logprobs.append(pb.TokenLogprob(
                            token_id=tok, logprob=entry[tok],
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.items()]))
                if out.finished:
                    msg.finish_reason = comp.finish_reason or "abort"
                    msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                                                completion_tokens=len(comp.token_ids),
                                                cached_prompt_tokens=out.num_cached_tokens))
                yield msg
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except NotReady as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except EngineFailure as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - a status, never UNKNOWN
            log.exception("request failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class _RecordingContext:
    """The servicer context, remembering the status we abort with (for the access log)."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self._context = context
        self.status = "OK"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = code.name
        await self._context.abort(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def build_grpc_server(service: GenerationService, address: str, tls: tuple[bytes, bytes] | None = None,
                      max_message_bytes: int = 64 << 20) -> tuple[grpc.aio.Server, health.HealthServicer]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", max_message_bytes)])
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.generate, request_deserializer=None, response_serializer=pb.GenerateResponse.SerializeToString),
    })
    server.add_generic_rpc_handlers((handler,))
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    if tls is not None:
        creds = grpc.ssl_server_credentials([(tls[1], tls[0])])  # (private key, certificate chain)
        server.add_secure_port(address, creds)
    else:
        server.add_insecure_port(address)
    return server, health_servicer


async def set_health(health_servicer: Any, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        result = health_servicer.set(name, status)
        if hasattr(result, "__await__"):
            await result
