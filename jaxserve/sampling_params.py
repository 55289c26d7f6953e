"""SamplingParams, named and defaulted as vLLM's, validated at construction."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # top-n logprobs computed on device for every sampled token
MAX_N = 16
# Ranges the device arrays can hold: the sampler takes int32 and float32 per-sequence values, so a
# value outside them would fail a whole step (every request in it), not just its own request.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4e38
MAX_STOP = 64  # stop strings per request (each matched against the text after every token)
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# logit_bias: OpenAI's range of a bias; entries per request bounded because every sampler row of a
# step that carries a bias sends this many (id, value) pairs to the device (engine/sampler.py).
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0


MAX_CHOICES = 1024  # structured output: strings in a `choice` list
MAX_GRAMMAR_CHARS = 1 << 20  # structured output: a schema, regex or grammar, in characters

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, vLLM's names: exactly one of `json` (a JSON schema, as a dict or
    its JSON text), `regex`, `choice` (the output is one of these strings), `grammar` (Lark or GBNF,
    as llguidance reads them) or `json_object=True` (any JSON object). `disable_any_whitespace`:
    JSON without free whitespace between tokens. Only the shape is checked here; whether the schema,
    regex or grammar compiles is checked when the request is added (jaxserve/engine/structured.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object"
                             + (f"; got {', '.join(given)}" if given else ""))
        if isinstance(self.json, str):
            if len(self.json) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"structured_outputs.json must be at most {MAX_GRAMMAR_CHARS} characters")
            try:
                parsed = _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string of at most "
                                 f"{MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")

    @classmethod
    def from_dict(cls, d: Any) -> "StructuredOutputsParams":
        """From the `structured_outputs` body of a request (unknown keys are refused by name)."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError("structured_outputs must be an object")
        known = set(_STRUCTURED_KINDS) | {"disable_any_whitespace"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unsupported field(s) {', '.join(unknown)}")
        return cls(**d)

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-n logprobs of every prompt token (vLLM's name; OpenAI's echo)
    n: int = 1
    skip_special_tokens: bool = True
    # Constrained decoding (vLLM's name): a StructuredOutputsParams, or a dict of its fields.
    structured_outputs: StructuredOutputsParams | None = None
    # Speculative decoding, per request (a jaxserve extension): at most this many draft tokens a
    # step (0: none); None: as the server's --speculative-config says. Never more than it allows.
    num_speculative_tokens: int | None = None
    # Token id -> bias added to its logit before penalties, temperature and truncation (vLLM's and
    # OpenAI's name); values in [-100, 100]. Ids are checked against the vocabulary when the
    # request is added (the engine knows the model).
    logit_bias: dict[int, float] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            shown = repr(getattr(self, name))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."  # a 1e400-digit int stays readable
            return ValueError(f"{name} {why}, got {shown}")

        def finite(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "must be a number")
            try:
                number = float(value)
            except OverflowError:  # an int past float's range
                raise bad(name, "must be a finite number") from None
            if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
                raise bad(name, "must be a finite number")
            return number

        def integer(name: str, allow_none: bool = False, lo: int = -INT32_MAX - 1, hi: int = INT32_MAX) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "must be an integer")
            if not lo <= value <= hi:
                raise bad(name, f"must be in [{lo}, {hi}]")

        def boolean(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")

        integer("max_tokens", allow_none=True)  # range: int32 (below)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        integer("min_tokens")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if finite("temperature") < 0:
            raise bad("temperature", "must be >= 0")
        top_p = finite("top_p")
        if not 0.0 < top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        integer("top_k")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 0")  # above int32 refused by integer()
        if not 0.0 <= finite("min_p") <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        integer("seed", allow_none=True, lo=-(2**63), hi=2**63 - 1)  # protobuf's int64, OpenAI's seed
        boolean("ignore_eos")
        boolean("skip_special_tokens")
        if finite("repetition_penalty") <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= finite("presence_penalty") <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= finite("frequency_penalty") <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        integer("logprobs", allow_none=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        integer("prompt_logprobs", allow_none=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        integer("num_speculative_tokens", allow_none=True, lo=0)
        integer("n")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be in [1, {MAX_N}]")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise bad("stop", "must be a string or a list of strings")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "must be non-empty strings")
        if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise bad("stop", f"must be at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
        self.stop_strings = stop
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise bad("stop_token_ids", "must be a list of integers")
        ids = list(self.stop_token_ids or [])
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in ids):
            raise bad("stop_token_ids", f"must be integers in [0, {INT32_MAX}]")
        self.stop_token_ids = ids
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.logit_bias = _check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check_logit_bias(bias: Any) -> dict[int, float] | None:
    """A {token id: bias} dict of ints to finite floats in [-100, 100], at most MAX_LOGIT_BIAS
    entries; None (or an empty dict) means no bias."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token ids to numbers, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    def shown(x: Any) -> str:
        r = repr(x)
        return r if len(r) <= 40 else r[:37] + "..."

    out: dict[int, float] = {}
    for tok, value in bias.items():
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok <= INT32_MAX:
            raise ValueError(f"logit_bias keys must be token ids (integers in [0, {INT32_MAX}]), got {shown(tok)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias values must be numbers, got {shown(value)} for token {tok}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not -LOGIT_BIAS_RANGE <= number <= LOGIT_BIAS_RANGE:  # (NaN fails both comparisons)
            raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                             f"got {shown(value)} for token {tok}")
        out[tok] = number
    return out or None
