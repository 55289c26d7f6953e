"""SamplingParams, named and defaulted as vLLM's, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top-n logprobs computed on device for every sampled token
MAX_N = 16


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
    n: int = 1
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        def finite(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise bad(name, "must be a number")
            return float(value)

        def integer(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "must be an integer")

        integer("max_tokens", allow_none=True)
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
            raise bad("top_k", "must be -1 (disabled) or >= 0")
        if not 0.0 <= finite("min_p") <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        integer("seed", allow_none=True)
        if finite("repetition_penalty") <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= finite("presence_penalty") <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= finite("frequency_penalty") <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        integer("logprobs", allow_none=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        integer("n")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be in [1, {MAX_N}]")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "must be non-empty strings")
        self.stop_strings = stop
        ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
