"""The host-side scheduler: decides each step's batch and hands the runner plain arrays.

Every step: running sequences first (each decode costs one token of the budget, an unfinished
prefill continues by a chunk), then waiting requests are admitted while the sequence cap, the token
budget and the page pool allow (chunked prefill: a long prompt takes what budget is left and goes
on next step, so it never stalls the decodes). When pages run short, unreferenced prefix-cache
leaves are evicted first; then the newest running request is preempted by recompute.

The n completions of one prompt (a group) prefill it once: while one sibling computes the prompt
the others wait without holding anyone else up, then each forks from it, sharing its full prompt
pages (refcounted in the pool, with or without the prefix cache) and recomputing only the partial
last page. Recomputing that tail (at most page_size - 1 tokens, plus the last prompt token whose
logits each sibling needs to sample its first token anyway) rides in the ordinary step; a device
page copy would need a second compiled function and a dispatch of its own for a few tokens' work.

A request whose inputs cannot be prepared (a value the device arrays cannot hold) is failed alone:
finished as "abort" with `Request.error` set and handed to the engine through `take_failed()`.
"""

from __future__ import annotations

import time

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from jaxserve.attention import NULL_PAGE
from jaxserve.cache.page_pool import OutOfPagesError, PagePool
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.sampler import MAX_BANNED, empty_sampling_arrays
from jaxserve.engine.speculative import (DraftProposer, SpecDecodeStats, SpeculativeConfig, accepted_length,
                                         draft_limit, make_proposer, record_verification)
from jaxserve.engine.structured import fill_masks

_INT32_MAX = 2**31 - 1
_WAIT = object()  # _group_source: a sibling is computing the prompt; wait for it


def ragged_layout(starts: np.ndarray, lens: np.ndarray, page_rows: list, bucket: tuple[int, int, int],
                  page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The attention arrays of a ragged step whose sequence i computes lens[i] tokens from
    position starts[i], its KV pages listed by page_rows[i] (at least P wide, or exactly its
    pages): (positions [T], slot mapping [T], kv_lens [S], page tables [S, P], cu_q_lens [S + 1]),
    padded to the bucket (T, S, P), by whole-array numpy operations."""
    T, S, P = bucket
    n = len(lens)
    num_tokens = int(lens.sum())
    cu = np.zeros(S + 1, np.int32)
    np.cumsum(lens, out=cu[1: n + 1])
    cu[n + 1:] = num_tokens
    row_seq = np.repeat(np.arange(n, dtype=np.int32), lens)  # flat row -> its sequence
    pos = starts[row_seq] + np.arange(num_tokens, dtype=np.int32) - cu[row_seq]
    positions = np.zeros(T, np.int32)
    positions[:num_tokens] = pos
    tables = np.full((S, P), NULL_PAGE, np.int32)
    for i, row in enumerate(page_rows):
        width = min(len(row), P)
        tables[i, :width] = row[:width]
    slots = np.full(T, NULL_PAGE * page_size, np.int32)  # padding writes into the null page
    slots[:num_tokens] = tables[row_seq, pos // page_size] * page_size + pos % page_size
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:n] = starts + lens
    return positions, slots, kv_lens, tables, cu


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int  # tokens computed this step
    sample: bool  # this chunk reaches the end of the known tokens: a new token comes out
    offset: int = 0  # flat row of the chunk's first token in the step (set when the plan is built)
    # Speculative decoding: draft tokens that follow the chunk's last known token (counted in
    # num_tokens); the step draws a token at each of the 1 + len(drafts) positions.
    drafts: list[int] = field(default_factory=list)
    row: int = 0  # the sampler row of the chunk's first sampled position (set when the plan is built)


@dataclass
class StepPlan:
    """One step, as plain padded numpy arrays (the only thing the runner sees) plus bookkeeping."""

    seqs: list[ScheduledSeq]
    num_tokens: int  # real tokens before padding
    tokens: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    kv_lens: np.ndarray  # [S]
    page_tables: np.ndarray  # [S, P]
    cu_q_lens: np.ndarray  # [S + 1]
    num_seqs: np.ndarray  # [1]
    logits_indices: np.ndarray  # [S] flat row of each sequence's last token
    sampling: dict[str, np.ndarray]
    # [T] per flat row: -1, or the index, in the previous step's sampled ids, of this row's input
    # token (a decode planned while that step still ran: the device fills the token in).
    token_src: np.ndarray | None = None
    # [T] per flat row: the next prompt token, whose logprob the row's logits give (prompt
    # logprobs), or -1. All -1 in an ordinary step, and the device then skips that work.
    prompt_targets: np.ndarray | None = None
    wants_prompt_logprobs: bool = False  # some row of prompt_targets is set
    # [S, ceil(V/32)] int32 allowed tokens per row (structured output), all -1 for unconstrained
    # rows; None when no row of the step is constrained.
    token_bitmask: np.ndarray | None = None
    # Constrained rows whose mask is made after the previous step is read (Scheduler.defer_masks):
    # the runner launches the model step first and samples once the mask is there.
    mask_deferred: bool = False
    preempted: list[Request] = field(default_factory=list)

    @property
    def bucket(self) -> tuple[int, int, int]:
        return self.tokens.shape[0], self.kv_lens.shape[0], self.page_tables.shape[1]


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        buckets: Buckets,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        history_len: int,
        num_penalty_slots: int | None = None,
        prefix_cache: object | None = None,
        policy: str = "fcfs",
        static: bool = False,
        speculative: SpeculativeConfig | None = None,
        proposer: DraftProposer | None = None,
        fit_drafts_to_bucket: bool = False,
    ):
        self.pool = pool
        self.buckets = buckets
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.history_len = history_len
        self.prefix_cache = prefix_cache
        self.policy = policy
        self.static = static
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Structured output under overlap: plan a constrained request while its token is still
        # being sampled, and make its mask once that token is read (deferred_token_bitmask). The
        # engine sets it when it overlaps steps.
        self.defer_masks = False
        self._running_groups: dict[str, list[Request]] = {}  # group_id -> its running siblings
        self._failed: list[Request] = []  # failed alone while preparing a step, not yet reported
        # Slots of the runner's penalty state: a running request that uses penalties holds one.
        self.num_penalty_slots = max_num_seqs if num_penalty_slots is None else num_penalty_slots
        if self.num_penalty_slots < max_num_seqs:
            raise ValueError(f"{self.num_penalty_slots} penalty slots cannot serve {max_num_seqs} sequences")
        self._free_penalty_slots = list(range(self.num_penalty_slots - 1, -1, -1))
        # Speculative decoding: the draft source, and what verification accepted so far.
        self.speculative = speculative
        # (A draft model's proposer is built by the engine, which owns the devices.)
        self.proposer = proposer or (make_proposer(speculative) if speculative is not None else None)
        self.spec_stats = SpecDecodeStats()
        self.num_steps = 0
        # On CPU a padding row costs what a real one does: drafts that would spill a step into the
        # next token bucket, mostly padding, are trimmed back to the bucket below.
        self.fit_drafts_to_bucket = fit_drafts_to_bucket

    # ---- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Finish (or abort) a request and return its pages at once."""
        if req.status == RequestStatus.FINISHED:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._leave_group(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if reason != "abort":
            self._cache_computed(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        if reason == "abort":
            req.finish_reason = "abort"
        self.requests.pop(req.request_id, None)
        if self.proposer is not None:
            self.proposer.release(req)

    def _cache_computed(self, req: Request) -> None:
        """Give the prefix cache the full pages of what this request computed."""
        if self.prefix_cache is None or req.num_computed_tokens == 0:
            return
        page_size = self.pool.page_size
        # Never past the known tokens: the input of a launched decode can still be unknown here.
        full = min(req.num_computed_tokens, req.num_tokens) // page_size
        if full == 0:
            return
        pages = self.pool.pages_of(req.request_id)[:full]
        self.prefix_cache.insert(req.all_token_ids[: full * page_size], pages)

    def _release(self, req: Request) -> None:
        if req.cache_node is not None:
            self.prefix_cache.unlock(req.cache_node)
            req.cache_node = None
        self.pool.free(req.request_id)
        # A launched step may still count a token into the slot: the next holder's first step
        # rebuilds it whole, and is launched after that one.
        if req.penalty_slot is not None:
            self._free_penalty_slots.append(req.penalty_slot)
            req.penalty_slot = None

    def check_invariants(self) -> None:
        """Penalty slots: each held by at most one running request, the rest free."""
        held = [r.penalty_slot for r in self.running if r.penalty_slot is not None]
        assert all(r.penalty_slot is None for r in self.waiting), "a waiting request holds a penalty slot"
        assert sorted(held + self._free_penalty_slots) == list(range(self.num_penalty_slots)), \
            (held, self._free_penalty_slots)

    def take_failed(self) -> list[Request]:
        """Requests failed alone since the last call (finished, pages freed, `error` set)."""
        failed, self._failed = self._failed, []
        return failed

    def _fail(self, req: Request, exc: BaseException) -> None:
        req.error = f"the request could not be prepared for the device: {type(exc).__name__}: {exc}"
        self.finish(req, "abort")
        self._failed.append(req)

    def _join_group(self, req: Request) -> None:
        if req.group_id is not None:
            self._running_groups.setdefault(req.group_id, []).append(req)

    def _leave_group(self, req: Request) -> None:
        members = self._running_groups.get(req.group_id) if req.group_id is not None else None
        if members is not None:
            members.remove(req)
            if not members:
                del self._running_groups[req.group_id]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._leave_group(req)
        self._cache_computed(req)  # its recompute will mostly hit the cache
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Pages for num_tokens tokens of a running request ahead of its step (an EAGLE-3 head
        drafts into the pages the request computes next), as the step would allocate them."""
        return self._grow(req, num_tokens)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make room for num_tokens tokens of req, evicting cache leaves if needed."""
        have = self.pool.num_pages_held(req.request_id) * self.pool.page_size
        need = -(-(num_tokens - have) // self.pool.page_size) if num_tokens > have else 0
        if need > self.pool.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.pool.num_free)
        try:
            self.pool.ensure_capacity(req.request_id, num_tokens)
            return True
        except OutOfPagesError:
            return False

    # ---- the decision -----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Request] = []
        self.num_steps += 1
        # Draft tokens take sampler rows: a step samples at most max_num_seqs rows (one per
        # sequence, plus one per draft), so drafts use only the room fewer sequences leave,
        # after the waiting requests' rows.
        num_drafts = 0
        speculate = self._speculating()
        spare_rows = self._spare_rows()

        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if len(req.output_token_ids) + req.num_pending >= req.max_tokens:
                continue  # its last token is being sampled: it finishes when that arrives
            if req.constraint is not None and req.num_pending and not self.defer_masks:
                continue  # structured output: its next mask needs the token still being sampled
            n = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            drafts: list[int] = []
            if speculate and n == 1:
                drafts = self._propose(req, min(budget - 1, spare_rows - num_drafts))
            sample = req.num_computed_tokens + n == req.num_tokens + req.num_pending
            if drafts and not self._grow(req, req.num_computed_tokens + n + len(drafts)):
                drafts = []  # drafts never preempt anyone
            n += len(drafts)
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.append(ScheduledSeq(req, req.num_computed_tokens, n, sample, drafts=drafts))
            budget -= n
            num_drafts += len(drafts)

        can_admit = not preempted and (not self.static or not self.running)
        if can_admit:
            self._order_waiting()
        # Siblings waiting for a group member's prompt step aside for this step, keeping their
        # place in the queue: they hold up nobody behind them.
        deferred: list[Request] = []
        # Static batching admits a whole batch at once; its prefills then proceed chunk by chunk.
        while can_admit and self.waiting and len(self.running) + num_drafts < self.max_num_seqs:
            if budget <= 0 and not self.static:
                break
            req = self.waiting[0]
            source = self._group_source(req)
            if source is _WAIT or req.num_pending:  # (preempted with a token still being sampled)
                deferred.append(self.waiting.popleft())
                continue
            cached = self._share_prompt(req, source) if source is not None else self._match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                self._release(req)
                req.num_computed_tokens = 0  # prompt-logprob entries copied from a sibling stay valid
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                # What the client's prompt got from the prefix cache is decided once, at the first
                # admission: a recompute after preemption reuses the request's own pages, which
                # the client did not send twice.
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = min(cached, req.num_prompt_tokens)
            self.running.append(req)
            self._join_group(req)
            if n > 0:
                scheduled.append(ScheduledSeq(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens))
                budget -= n
        self.waiting.extendleft(reversed(deferred))

        if not scheduled:
            if self.running or self.waiting:
                if not self.running and not deferred:
                    # Nothing runs and the head of the queue does not fit an empty pool: it never will.
                    raise OutOfPagesError(
                        f"request {self.waiting[0].request_id} needs more KV pages than the pool holds"
                    )
            return None
        if num_drafts and self.fit_drafts_to_bucket:
            self._fit_drafts(scheduled)
        # Decodes first, then prefill chunks (the ragged kernels expect that order).
        scheduled.sort(key=lambda s: s.num_tokens > 1)
        return self._build_plan(scheduled, preempted)

    def _speculating(self) -> bool:
        return self.proposer is not None and (self.speculative.disable_by_batch_size is None
                                              or len(self.running) <= self.speculative.disable_by_batch_size)

    def _spare_rows(self) -> int:
        """Sampler rows drafts may take: those neither a running nor a waiting request needs. A
        waiting request comes first: drafts that fill its row would keep it queued behind
        sequences that decode several tokens a step while it waits for all of them."""
        return max(0, self.max_num_seqs - len(self.running) - len(self.waiting))

    def _drafts_worth(self, req: Request) -> int:
        """How many drafts a running request may get now: at most its own num_speculative_tokens;
        none while it prefills or has a token pending, while its drafts back off, for structured output (its masks follow the grammar
        token by token), or with penalties whose state is not on the device yet (drafts would be
        counted before it is built). The drafts and the token after them must fit max_tokens."""
        cap = req.params.num_speculative_tokens
        if (cap == 0 or req.num_pending or req.constraint is not None or not req.output_token_ids
                or req.num_computed_tokens != req.num_tokens - 1
                or self.num_steps < req.spec_paused_until
                or (req.params.uses_penalties and req.penalty_slot is None)):
            return 0
        worth = draft_limit(req, self.speculative)
        if worth == 0:
            # Its drafts keep failing: pause, then judge afresh (the text may turn repetitive later,
            # as an edit's copied part does).
            req.spec_paused_until = self.num_steps + self.speculative.backoff_steps
            req.spec_accepted = req.spec_rejected = 0.0
            return 0
        if cap is not None:
            worth = min(worth, cap)
        return max(0, min(worth, req.max_tokens - len(req.output_token_ids) - 1))

    def draft_candidates(self) -> list[tuple[Request, int]]:
        """(request, most drafts) of the running requests that may get drafts next step, for a
        proposer that drafts them all at once before the step is scheduled (a draft model): in
        the order schedule() hands out the spare sampler rows, and no more drafts than those."""
        spare = self._spare_rows() if self._speculating() else 0
        wanted = []
        for req in self.running:
            if spare <= 0:
                break
            n = min(self._drafts_worth(req), spare)
            if n > 0:
                wanted.append((req, n))
                spare -= n
        return wanted

    def _propose(self, req: Request, limit: int) -> list[int]:
        """Draft tokens for a decoding request, at most `limit` (the step's spare sampler rows)."""
        limit = min(limit, self._drafts_worth(req)) if limit > 0 else 0
        return self.proposer.propose(req, limit) if limit > 0 else []

    def _fit_drafts(self, scheduled: list[ScheduledSeq]) -> None:
        """Trim drafts, last positions first (the least likely accepted), so that the step fills
        the largest token bucket it reaches instead of padding the next one, when more than half
        of the rows the drafts would add there are padding. Only from 16 rows up: below that the
        weight read dominates a CPU step (a 1-row decode of the default model ~44 ms, each more
        row ~2 ms: scripts/bench_small_batch.py), and a draft is worth more than its padding."""
        total = sum(s.num_tokens for s in scheduled)
        buckets = self.buckets.token_buckets
        lower = [t for t in buckets if t <= total]
        upper = next((t for t in buckets if t >= total), total)
        if not lower or lower[-1] < 16 or upper == total or upper - total <= total - lower[-1]:
            return
        excess = total - lower[-1]
        with_drafts = [s for s in scheduled if s.drafts]
        while excess > 0 and with_drafts:
            s = max(with_drafts, key=lambda x: len(x.drafts))
            s.drafts.pop()
            s.num_tokens -= 1
            excess -= 1
            if not s.drafts:
                with_drafts.remove(s)

    def _record_verification(self, req: Request, proposed: int, accepted: int) -> None:
        self.spec_stats.record(proposed, accepted)
        record_verification(req, proposed, accepted)

    def _shareable_tokens(self, req: Request) -> int:
        """Prompt tokens a sibling can take over: whole pages, short of the last prompt token
        (each sibling computes that one itself, for the logits of its own first token)."""
        return (req.num_prompt_tokens - 1) // self.pool.page_size * self.pool.page_size

    def _group_source(self, req: Request) -> Request | object | None:
        """For a waiting sibling: a running one whose prompt pages it can share, _WAIT while one
        is still computing them, or None (compute alone: no group, nothing worth sharing, or no
        sibling running, in which case this one computes the prompt for the others)."""
        if req.group_id is None or self.static or req.num_computed_tokens > 0:
            return None
        members = self._running_groups.get(req.group_id)
        share = self._shareable_tokens(req)
        if not members or share == 0:
            return None
        for m in members:
            # A sibling's first `share` positions are prompt tokens whatever it has generated since.
            if m.num_computed_tokens >= share and (req.prompt_logprobs is None or m.prompt_logprob_rows >= share):
                return m
        return _WAIT

    def _share_prompt(self, req: Request, source: Request) -> int:
        """Fork req from a running sibling: take its full prompt pages (one more reference each)
        and, with prompt logprobs, the entries those pages' rows gave. Returns 0: nothing came
        from the prefix cache."""
        share = self._shareable_tokens(req)
        self.pool.append_shared(req.request_id, self.pool.pages_of(source.request_id)[: share // self.pool.page_size])
        req.num_computed_tokens = share
        if req.prompt_logprobs is not None:
            req.prompt_logprobs[: share + 1] = source.prompt_logprobs[: share + 1]
            req.prompt_logprob_rows = max(req.prompt_logprob_rows, share)
        return 0

    def _order_waiting(self) -> None:
        if self.policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time)))
        elif self.policy == "lpm" and self.prefix_cache is not None and len(self.waiting) > 1:
            hits = {id(r): self.prefix_cache.match_prefix(r.all_token_ids, max_tokens=r.num_tokens - 1, peek=True)[1]
                    for r in self.waiting}
            self.waiting = deque(sorted(self.waiting, key=lambda r: -hits[id(r)]))

    def _match_prefix(self, req: Request) -> int:
        """Start req from the longest cached prefix; returns the tokens it got from the cache."""
        if self.prefix_cache is None or req.num_computed_tokens > 0 or self.pool.num_pages_held(req.request_id):
            return 0
        limit = req.num_tokens - 1
        if req.prompt_logprobs is not None:
            # The cache holds KV, not logprobs: only rows already scored may be skipped (vLLM
            # likewise bypasses the cache for prompt logprobs).
            limit = min(limit, req.prompt_logprob_rows)
        pages, n, node = self.prefix_cache.match_prefix(req.all_token_ids, max_tokens=limit)
        if n == 0:
            return 0
        self.prefix_cache.lock(node)
        req.cache_node = node
        self.pool.append_shared(req.request_id, pages)
        req.num_computed_tokens = n
        return n

    def _build_plan(self, scheduled: list[ScheduledSeq], preempted: list[Request]) -> StepPlan | None:
        """The step's arrays. Per sequence only O(1) Python (plus the tokens of a prefill chunk);
        positions, slots and page tables are filled by whole-array numpy operations."""
        page_size = self.pool.page_size
        if not scheduled:
            return None
        # The [S, history] array only when a request starts sampling with penalties: its history
        # goes to the device once, into its slot of the penalty state; otherwise the runner
        # passes a constant that already sits on the device.
        builds_penalties = any(s.sample and s.request.params.uses_penalties and s.request.penalty_slot is None
                               for s in scheduled)
        # The logit-bias arrays only when some request has a bias: other steps send none.
        has_bias = any(s.request.params.logit_bias for s in scheduled)
        while True:  # once more without any request whose sampling values fail (rare)
            failed: list[ScheduledSeq] = []
            num_tokens = sum(s.num_tokens for s in scheduled)
            max_pages = max(self.pool.num_pages_held(s.request.request_id) for s in scheduled)
            T, S, P = self.buckets.pick(num_tokens, max_pages)
            samp = empty_sampling_arrays(S, self.history_len, with_history=builds_penalties,
                                         with_logit_bias=has_bias)
            row = 0
            for s in scheduled:  # a sampler row per sequence, and one per draft token
                s.row, row = row, row + 1 + len(s.drafts)
            assert row <= S, f"{row} sampler rows in a bucket of {S}"  # drafts are capped to fit
            for s in scheduled:
                try:
                    # Sampling first: it is what can fail on a user's value, before any row is written.
                    self._fill_sampling(samp, s.row, s.request)
                except Exception as exc:  # noqa: BLE001 - any failure here is this request's alone
                    self._fail(s.request, exc)
                    failed.append(s)
            if not failed:
                break
            scheduled = [s for s in scheduled if all(s is not f for f in failed)]  # rows stay dense
            if not scheduled:
                return None
        for s in scheduled:  # the rows are final: penalty slots can be handed out
            if s.sample and s.request.params.uses_penalties:
                self._fill_penalties(samp, s.row, s.request)
            if s.drafts:
                self._fill_draft_rows(samp, s)
        n = len(scheduled)
        starts = np.fromiter((s.start for s in scheduled), np.int32, n)
        lens = np.fromiter((s.num_tokens for s in scheduled), np.int32, n)
        positions, slots, kv_lens, tables, cu = ragged_layout(
            starts, lens, [self._page_row(s.request) for s in scheduled], (T, S, P), page_size)
        logits_idx = np.zeros(S, np.int32)
        last_rows = np.fromiter((s.row + len(s.drafts) for s in scheduled), np.int32, n)
        logits_idx[last_rows] = cu[1: n + 1] - 1
        for i, s in enumerate(scheduled):  # a draft row's logits are those of the position before it
            d = len(s.drafts)
            if d:
                logits_idx[s.row: s.row + d] = np.arange(cu[i + 1] - 1 - d, cu[i + 1] - 1, dtype=np.int32)
        tokens = np.zeros(T, np.int32)
        token_src = np.full(T, -1, np.int32)
        targets = np.full(T, -1, np.int32)
        wants_prompt_logprobs = False
        flat: list[int] = []
        for i, s in enumerate(scheduled):
            req = s.request
            s.offset = off = int(cu[i])
            end = s.start + s.num_tokens - len(s.drafts)
            known = min(end, req.num_tokens)
            flat += req.token_slice(s.start, known)
            if end > known:  # the last input is the token the launched step is sampling
                token_src[off + end - 1 - s.start] = req.sample_row
                flat.append(0)
            flat += s.drafts
            if req.prompt_logprobs is not None and s.start < req.prompt_logprob_rows_needed:
                last = min(end, req.prompt_logprob_rows_needed)
                targets[off: off + last - s.start] = req.prompt_token_ids[s.start + 1: last + 1]
                wants_prompt_logprobs = True
        tokens[:num_tokens] = flat
        constrained = any(s.sample and s.request.constraint is not None for s in scheduled)
        bitmask = None if self.defer_masks else self._token_bitmask(scheduled, S)
        for i, s in enumerate(scheduled):  # the plan is final: its tokens count as computed
            s.request.num_computed_tokens = s.start + s.num_tokens
            if s.sample:
                s.request.num_pending += 1
                s.request.sample_row = s.row + len(s.drafts)
        return StepPlan(
            seqs=scheduled, num_tokens=num_tokens, tokens=tokens, positions=positions, slot_mapping=slots,
            kv_lens=kv_lens, page_tables=tables, cu_q_lens=cu, num_seqs=np.asarray([n], np.int32),
            logits_indices=logits_idx, sampling=samp, token_src=token_src, prompt_targets=targets,
            wants_prompt_logprobs=wants_prompt_logprobs, token_bitmask=bitmask, preempted=preempted,
            mask_deferred=constrained and self.defer_masks,
        )

    def deferred_token_bitmask(self, plan: StepPlan) -> np.ndarray | None:
        """The mask of a plan made with `defer_masks`, once the step before it was read (its
        tokens advanced the matchers). A request that finished meanwhile gets no mask: its token is
        dropped when the plan's results arrive."""
        return self._token_bitmask([s for s in plan.seqs if s.request.status != RequestStatus.FINISHED],
                                   plan.bucket[1])

    @staticmethod
    def _token_bitmask(scheduled: list[ScheduledSeq], num_rows: int) -> np.ndarray | None:
        """The allowed tokens of each constrained row that samples this step (its matcher is up to
        date: a constrained request with a token pending is planned only with `defer_masks`, and
        its mask is then made after that token is read), or None."""
        rows = [(s.row, s.request.constraint) for s in scheduled
                if s.sample and s.request.constraint is not None]
        if not rows:
            return None
        words = (rows[0][1].vocab_size + 31) // 32
        mask = np.full((num_rows, words), -1, np.int32)
        fill_masks(rows, mask)
        return mask

    def _page_row(self, req: Request) -> np.ndarray:
        """The request's page table as a numpy row as wide as the widest page bucket, rebuilt only
        when the pool changed the table (every page_size tokens, or on admission): the pool
        replaces a table's list whenever it changes it, and the row keeps the list it copied
        alive, so identity says whether the row is current."""
        pages = self.pool.table(req.request_id)
        if req.page_table_list is not pages:
            row = np.full(self.buckets.page_buckets[-1], NULL_PAGE, np.int32)
            row[: len(pages)] = pages
            req.page_table_list, req.page_table_row = pages, row
        return req.page_table_row

    def _fill_sampling(self, samp: dict[str, np.ndarray], i: int, req: Request) -> None:
        p = req.params
        samp["temperature"][i] = p.temperature
        # A top_k past the vocabulary keeps every token: the same as no top-k.
        samp["top_k"][i] = min(p.top_k, _INT32_MAX) if p.top_k > 0 else 0
        samp["top_p"][i] = p.top_p
        samp["min_p"][i] = p.min_p
        samp["seeds"][i] = req.seed & 0xFFFFFFFF
        # Index of the token this row samples: tokens still being sampled by a launched step count.
        num_out = len(req.output_token_ids) + req.num_pending
        samp["steps"][i] = num_out
        samp["want_logprobs"][i] = p.logprobs is not None
        if p.logit_bias:  # (validated: at most MAX_LOGIT_BIAS entries, ids checked against the vocabulary)
            k = len(p.logit_bias)
            samp["logit_bias_ids"][i, :k] = np.fromiter(p.logit_bias.keys(), np.int32, k)
            samp["logit_bias_values"][i, :k] = np.fromiter(p.logit_bias.values(), np.float32, k)
        if num_out < p.min_tokens:
            # A stop id past int32 is past any vocabulary: never sampled, nothing to ban.
            banned = ([] if p.ignore_eos else list(req.eos_token_ids)) + [t for t in p.stop_token_ids
                                                                          if t <= _INT32_MAX]
            banned = banned[:MAX_BANNED]
            samp["banned"][i, : len(banned)] = banned

    @staticmethod
    def _fill_draft_rows(samp: dict[str, np.ndarray], s: ScheduledSeq) -> None:
        """The rows after a sequence's first sampled position: its sampling values, one output index
        further each (the seed's noise and min_tokens follow the output index), the draft each row's
        draw is checked against, and where the sequence's rows start (for acceptance on device)."""
        first, d = s.row, len(s.drafts)
        rows = slice(first + 1, first + d + 1)
        for name, a in samp.items():
            if a is not None and name not in ("history", "penalty_init", "pending_src", "pending_col"):
                a[rows] = a[first]
        ahead = np.arange(1, d + 1, dtype=np.int32)
        samp["steps"][rows] += ahead
        p = s.request.params
        # min_tokens bans EOS and stop ids while the output index is below it.
        samp["banned"][rows][samp["steps"][rows] >= p.min_tokens] = -1
        samp["verify"][first: first + d] = s.drafts
        samp["row_start"][first: first + d + 1] = first

    def _fill_penalties(self, samp: dict[str, np.ndarray], i: int, req: Request) -> None:
        """Penalty values and slot of a row that samples; a request new to its slot sends its
        history (the plan then has the history array), once."""
        p = req.params
        samp["repetition_penalty"][i] = p.repetition_penalty
        samp["presence_penalty"][i] = p.presence_penalty
        samp["frequency_penalty"][i] = p.frequency_penalty
        if req.penalty_slot is None:
            if not self._free_penalty_slots:  # a slot per running request: never, unless a bug
                raise RuntimeError(f"no free penalty slot among {self.num_penalty_slots} "
                                   f"with {len(self.running)} requests running")
            req.penalty_slot = self._free_penalty_slots.pop()
            samp["penalty_init"][i] = True
            # The last history_len tokens; a pending one (at most one: the input of this decode)
            # goes last, filled in on device from the launched step's sampled ids.
            pend = req.num_pending
            hist = req.token_slice(max(0, req.num_tokens - (self.history_len - pend)), req.num_tokens)
            samp["history"][i, : len(hist)] = hist
            if pend:
                samp["pending_src"][i] = req.sample_row
                samp["pending_col"][i] = len(hist)
            total = req.num_tokens + pend
            samp["prompt_lens"][i] = max(0, req.num_prompt_tokens - (total - len(hist) - pend))
        samp["penalty_slot"][i] = req.penalty_slot

    # ---- after the device step --------------------------------------------------------------
    def update(self, plan: StepPlan, token_ids: np.ndarray, logprobs: tuple | None = None,
               prompt_logprobs: tuple | None = None) -> list[tuple[Request, int]]:
        """Advance the scheduled sequences by the step's result; return (request, new token) pairs.
        Requests that hit a token-level stop are finished here and their pages freed.
        `prompt_logprobs`: (target logprob [T], top ids [T, K], top logprobs [T, K]) of the flat
        rows, when the plan asked for them."""
        new_tokens = []
        for i, s in enumerate(plan.seqs):
            req = s.request
            if s.sample:
                req.num_pending -= 1
            if req.status == RequestStatus.FINISHED:
                continue  # aborted or stopped while the step ran (its pages are already free)
            # A request preempted after this step was launched still gets the step's results: its
            # pages were freed after the step's reads on the device.
            if prompt_logprobs is not None and req.prompt_logprobs is not None:
                self._store_prompt_logprobs(req, s, prompt_logprobs)
            accepted = 0
            if s.drafts:
                accepted = accepted_length(s.drafts, token_ids[s.row: s.row + len(s.drafts)])
                self._record_verification(req, len(s.drafts), accepted)
                if req.status == RequestStatus.RUNNING:
                    # The rejected drafts' KV is wrong: only the input and the accepted drafts count
                    # as computed (their slots are overwritten later, and never reach the prefix cache).
                    req.num_computed_tokens = s.start + 1 + accepted
            elif s.num_tokens > 1 and req.status == RequestStatus.RUNNING:
                # Share each prefill chunk's full pages at once: requests with the same beginning
                # (n > 1 siblings, a common system prompt) admitted next step reuse them.
                self._cache_computed(req)
            if not s.sample:
                continue
            # The accepted drafts, then the token drawn after the last of them; a stop among them
            # ends the request there.
            for row in range(s.row, s.row + accepted + 1):
                tok = int(token_ids[row])
                req.output_token_ids.append(tok)
                if logprobs is not None and req.params.logprobs is not None:
                    lp, top_ids, top_lp = logprobs
                    k = req.params.logprobs
                    req.output_logprobs.append((float(lp[row]), top_ids[row, :k].tolist(), top_lp[row, :k].tolist()))
                new_tokens.append((req, tok))
                if req.constraint is not None and self._advance_constraint(req, tok):
                    break
                if req.check_stop_token():
                    self.finish(req, req.finish_reason)
                    break
        return new_tokens

    def _advance_constraint(self, req: Request, tok: int) -> bool:
        """Feed a sampled token to the request's matcher; finish the request if its grammar is
        complete ("stop") or rejected the token ("abort", with `error`). Returns whether it finished."""
        constraint = req.constraint
        if not constraint.accept(tok):
            req.error = f"structured output: the grammar rejected token {tok}: {constraint.error}"
            self.finish(req, "abort")
            return True
        if constraint.finished:
            req.finish_reason, req.stop_reason = "stop", None  # (as for EOS: no stop string or id)
            self.finish(req, "stop")
            return True
        return False

    @staticmethod
    def _store_prompt_logprobs(req: Request, s: ScheduledSeq, result: tuple) -> None:
        end = min(s.start + s.num_tokens, req.prompt_logprob_rows_needed)
        if end <= s.start:
            return
        token_lp, top_ids, top_lp = result
        k = req.params.prompt_logprobs
        rows = slice(s.offset, s.offset + end - s.start)
        lps, ids, tops = token_lp[rows].tolist(), top_ids[rows, :k].tolist(), top_lp[rows, :k].tolist()
        for j, pos in enumerate(range(s.start, end)):
            # Row `pos` scores prompt token pos + 1 (first in the dict, as for sampled tokens).
            req.prompt_logprobs[pos + 1] = {req.prompt_token_ids[pos + 1]: lps[j], **dict(zip(ids[j], tops[j]))}
        req.prompt_logprob_rows = max(req.prompt_logprob_rows, end)
