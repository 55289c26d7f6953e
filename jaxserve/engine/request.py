"""A request's state through its lifecycle: waiting, running, preempted, finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # pages taken back; recomputed from scratch when readmitted
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, resolved against the context length
    seed: int  # params.seed, or one drawn by the engine: sampling is keyed by it
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    group_id: str | None = None  # the n completions of one prompt share a group (and its prompt pages)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float, list[int], list[float]]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV sits in the page pool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at (last) admission
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # leaving the waiting queue the first time
    # Set by the scheduler while the request holds a locked radix-cache node.
    cache_node: object | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def check_stop_token(self) -> bool:
        """Token-level stop conditions after a new token; sets finish_reason."""
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
                return True
            if last in self.params.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", last
                return True
        if n_out >= self.max_tokens:
            self.finish_reason = "length"
            return True
        return False
