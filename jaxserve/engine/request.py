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


# eq=False: a request is itself, compared by identity. Field-wise equality made every
# `req in self.running` compare whole token lists (O(batch^2 x length) host work per step).
@dataclass(eq=False)
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
    # Tokens whose KV sits in the page pool, or is being written by a launched step: advanced
    # when a step is scheduled, so that the next one can be planned before this one returns.
    num_computed_tokens: int = 0
    # Tokens being sampled by launched steps, not yet in output_token_ids (overlapped scheduling:
    # at most one). The last of them comes out of row `sample_row` of the launched step.
    num_pending: int = 0
    sample_row: int = -1
    # Its slot in the runner's device-resident penalty state while it runs (penalties only).
    penalty_slot: int | None = None
    # The scheduler's numpy copy of the pool's page table of this request, and the list it copied.
    page_table_list: object | None = field(default=None, repr=False)
    page_table_row: object | None = field(default=None, repr=False)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the first admission
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # leaving the waiting queue the first time
    # Set by the scheduler while the request holds a locked radix-cache node.
    cache_node: object | None = None
    # Why the engine failed this request alone (its step inputs could not be prepared); it is
    # then finished with finish_reason "abort".
    error: str | None = None
    # With params.prompt_logprobs: entry j (j >= 1) is {prompt[j]: logprob, top-n...} given
    # prompt[:j], entry 0 is None. Filled by position, so a recompute after preemption rewrites
    # the same values; `prompt_logprob_rows` counts the prompt rows (positions 0..) done so far.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_rows: int = 0
    # Structured output: the request's grammar matcher (jaxserve/engine/structured.Constraint), or
    # None. A constrained request is planned only with no token pending (its mask needs them all).
    constraint: object | None = field(default=None, repr=False)
    # Speculative decoding: accepted drafts and verifications that ended in a rejection (decayed
    # counts: speculative.draft_limit), and the scheduler step before which it proposes none.
    spec_accepted: float = 0.0
    spec_rejected: float = 0.0
    spec_paused_until: int = 0

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def prompt_logprob_rows_needed(self) -> int:
        """Rows whose logits score a later prompt token (every position but the last), or 0."""
        return 0 if self.prompt_logprobs is None else len(self.prompt_token_ids) - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of prompt and output (O(length): per-step code uses token_slice)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all of it (a decode reads one token)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p: end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

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
