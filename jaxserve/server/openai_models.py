"""The OpenAI request bodies as pydantic models (issue 19), the convention of vLLM and SGLang.

- `SamplingFields`: the one list of sampling fields, by their SamplingParams names, that
  completions, chat and gRPC share (`sampling_params` builds SamplingParams from them).
- `CompletionRequest` / `ChatCompletionRequest`: every field each route takes. Unknown keys are
  refused (extra="forbid"), at the top level and inside messages, content parts and
  stream_options, so nothing is silently dropped.
- `parse_request` turns a ValidationError into an InvalidRequest (HTTP 400, OpenAI's shape) whose
  `param` is the dotted path of the first bad field, e.g. `messages[2].tool_call_id`.

The models check JSON types (strict: `1` is not `True`, `"1"` is not a number; a float field takes
an int). Ranges stay in SamplingParams, structured outputs in structured_fields.py, tools in
tool_calls.py (those fields are declared here as `Any` and validated there); the accepted-with-no-
effect and refused-unless-unused rules come from request_fields.py's tables.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, create_model, field_validator, model_validator)

from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_N, SamplingParams
from jaxserve.server import request_fields
from jaxserve.server.common import InvalidRequest, make_sampling_params
from jaxserve.server.request_fields import shown
from jaxserve.server.structured_fields import FIELDS as STRUCTURED_FIELDS

COMPLETIONS_ROUTE = "/v1/completions"
CHAT_ROUTE = "/v1/chat/completions"


class FieldError(ValueError):
    """A model validator's error about one of the model's fields: pydantic's location stops at the
    model, so the field is carried here and appended to the path (`parse_request`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- sampling: shared by completions, chat and gRPC ------------------------------------------------

class SamplingFields(_Strict):
    """The sampling fields every front end takes, named as SamplingParams (which checks ranges).
    Route-specific ones (logprobs: an int on completions and gRPC, a bool on chat) are added by
    each route and passed to `sampling_params` as extras."""

    max_tokens: StrictInt | None = None
    min_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: Any = None  # a string or a list of strings (checked below: a union would garble the path)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    repetition_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    n: StrictInt | None = None
    logit_bias: Any = None  # OpenAI's {"token id": bias}; becomes {int: bias} (below)
    skip_special_tokens: StrictBool | None = None
    num_speculative_tokens: StrictInt | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (str, list)):
            raise ValueError(f"must be a string or a list of strings, got {shown(v)}")
        return v  # (each string: SamplingParams)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: Any) -> dict[int, Any] | None:
        """Keys as token ids; SamplingParams checks the values, the engine the vocabulary."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"must be an object mapping token ids to numbers, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:  # before parsing keys: the count alone refuses it
            raise ValueError(f"must hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        out: dict[int, Any] = {}
        for key, value in bias.items():
            text = key.strip()
            # int() alone would take "1_000" and "+5"; token ids are plain digits (OpenAI's rule too).
            if not text.isascii() or not text.isdigit() or len(text) > 10:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got "
                                 f"{shown(key if len(key) <= 40 else key[:37] + '...')}")
            tok = int(text)
            if tok in out:
                raise ValueError(f"names token {tok} twice")
            out[tok] = value
        return out


SAMPLING_FIELDS: tuple[str, ...] = tuple(SamplingFields.model_fields)


def sampling_params(fields: SamplingFields, **extra: Any) -> SamplingParams:
    """SamplingParams from the shared fields plus a route's own (None: SamplingParams' default)."""
    return make_sampling_params({**{name: getattr(fields, name) for name in SAMPLING_FIELDS}, **extra})


# ---- pieces of the request bodies ---------------------------------------------------------------------

def _rule(table: dict[str, tuple[Any, str]], name: str) -> Any:
    """A field checked by one of request_fields' rules (its 400 says what the value must be)."""
    ok, expected = table[name]

    def check(value: Any) -> Any:
        if not ok(value):
            raise ValueError(f"must be {expected}, got {shown(value)}")
        return value

    return Annotated[Any, AfterValidator(check)], None


StreamOptions = create_model("StreamOptions", __base__=_Strict,
                             **{k: _rule(request_fields.STREAM_OPTIONS, k) for k in request_fields.STREAM_OPTIONS})


class _RequestFields(SamplingFields):
    """What both routes take besides sampling."""

    model: Any = None  # (checked against the served model before parsing: a 404, not a 400)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None  # type: ignore[valid-type]
    return_token_ids: StrictBool | None = None
    priority: StrictInt | None = None  # vLLM's: honoured under --scheduling-policy priority


def _with_fields(name: str, base: type[BaseModel], names: Any, table: dict | None = None) -> Any:
    """`base` plus the fields `names`, each checked by its rule in `table` (or passed through as-is
    when `table` is None: another module validates it)."""
    fields = {n: _rule(table, n) if table is not None else (Any, None) for n in sorted(names)}
    return create_model(name, __base__=base, **fields)


# Structured-output fields: validated by structured_fields.py (one request may use one spelling).
_Structured = _with_fields("_Structured", _RequestFields, STRUCTURED_FIELDS)


# ---- /v1/completions ----------------------------------------------------------------------------------

class CompletionRequest(_with_fields("_CompletionTables", _Structured, request_fields.COMPLETIONS_EXTRA,
                                     request_fields.RULES)):
    prompt: Any  # after validation: a list of prompts, each a string or a list of token ids
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        def ids(p: Any) -> bool:
            return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

        if (isinstance(prompt, str) and prompt) or ids(prompt):
            return [prompt]
        if isinstance(prompt, list) and prompt and all((isinstance(p, str) and p) or ids(p) for p in prompt):
            return prompt
        raise ValueError("must be a non-empty string, list of strings, list of token ids or list of token-id lists")

    @model_validator(mode="after")
    def _combinations(self) -> CompletionRequest:
        if self.best_of is not None:
            n = 1 if self.n is None else self.n
            if not 1 <= self.best_of <= MAX_N:
                raise FieldError("best_of", f"must be an integer in [1, {MAX_N}], got {self.best_of}")
            if self.best_of < n:
                raise FieldError("best_of", f"({self.best_of}) must be >= n ({n})")
            if self.stream and self.best_of != n:  # the choice is made once every candidate is done
                raise FieldError("best_of", "is not supported with stream")
        if self.echo and self.stream:
            raise FieldError("echo", "is not supported with stream")
        return self


# ---- /v1/chat/completions -----------------------------------------------------------------------------

class TextPart(_Strict):
    """A content part: only text here (image, audio and file parts are refused by their type)."""

    type: str
    text: StrictStr

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(f"must be 'text' (only text parts are supported), got {shown(kind)}")
        return kind


# A key only these roles may carry (the others would drop it silently in the chat template).
_ROLE_ONLY = {"tool_calls": ("assistant",), "tool_call_id": ("tool",)}


class ChatMessage(_Strict):
    """One chat message. `content`: a string (one text part here), text parts, or null in an
    assistant message with tool_calls."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None = None
    name: StrictStr | None = None  # the chat template's to render (http_server.render_chat)
    tool_calls: list[dict[str, Any]] | None = None  # (their shape: tool_calls.check_history)
    tool_call_id: StrictStr | None = None
    # Keys of OpenAI's own assistant messages, which agents replay in a history (a conversation may
    # have begun on another server): accepted while empty, since nothing here produces them.
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @field_validator("annotations")
    @classmethod
    def _no_annotations(cls, v: Any) -> Any:
        if v:
            raise ValueError("must be empty or null (no annotations are rendered)")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _string_as_part(cls, content: Any) -> Any:
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        if content is not None and not isinstance(content, list):
            raise ValueError("must be a string, a list of text parts, or null with tool_calls")
        return content

    @model_validator(mode="after")
    def _per_role(self) -> ChatMessage:
        for key, roles in _ROLE_ONLY.items():
            if getattr(self, key) is not None and self.role not in roles:
                raise FieldError(key, f"is only allowed in {' or '.join(roles)} messages, not {self.role}")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("content", "may be null only in an assistant message with tool_calls")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: the text parts joined by newlines."""
        out: dict[str, Any] = {"role": self.role, "content": "\n".join(p.text for p in self.content or [])}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_with_fields("_ChatTables", _Structured, request_fields.CHAT_EXTRA,
                                         request_fields.RULES)):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer max_tokens; wins when both are given
    tools: Any = None  # tools, tool_choice, parallel_tool_calls: validated by tool_calls.py
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    @model_validator(mode="after")
    def _combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        return self


# ---- parsing ------------------------------------------------------------------------------------------

def parse_request(body: dict[str, Any], chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """The route's request model of a JSON body; InvalidRequest naming the first bad field."""
    model, route = (ChatCompletionRequest, CHAT_ROUTE) if chat else (CompletionRequest, COMPLETIONS_ROUTE)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc, route) from None


# pydantic's error types, in the words of the server's other 400s
_MUST_BE = {"bool_type": "a boolean", "int_type": "an integer", "float_type": "a number", "string_type": "a string",
            "list_type": "a list", "dict_type": "an object", "model_type": "an object", "too_short": "non-empty"}


def invalid_request(exc: ValidationError, route: str | None = None) -> InvalidRequest:
    """The first error of `exc` as an InvalidRequest: its param the dotted path (`a.b[2].c`)."""
    err = exc.errors(include_url=False)[0]
    loc = list(err["loc"])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        loc.append(cause.field)
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if err["type"] == "extra_forbidden":
        where = f"a field of {route}" if route and len(loc) == 1 else "a known field"
        message = f"{param} is not {where} on this server (unknown fields are refused, not ignored)"
    elif err["type"] == "missing":
        message = f"{param} is required"
    elif isinstance(cause, ValueError):
        message = f"{param} {cause}"
    elif err["type"] in _MUST_BE:
        message = f"{param} must be {_MUST_BE[err['type']]}, got {shown(err['input'])}"
    else:
        message = f"{param}: {err['msg']}, got {shown(err['input'])}"
    return InvalidRequest(message, param or None)
