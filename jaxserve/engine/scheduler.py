"""The host-side scheduler: decides each step's batch and hands the runner plain arrays.

Every step: running sequences first (each decode costs one token of the budget, an unfinished
prefill continues by a chunk), then waiting requests are admitted while the sequence cap, the token
budget and the page pool allow (chunked prefill: a long prompt takes what budget is left and goes
on next step, so it never stalls the decodes). When pages run short, unreferenced prefix-cache
leaves are evicted first; then the newest running request is preempted by recompute.
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


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int  # tokens computed this step
    sample: bool  # this chunk reaches the end of the known tokens: a new token comes out


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
        prefix_cache: object | None = None,
        policy: str = "fcfs",
        static: bool = False,
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

    def _cache_computed(self, req: Request) -> None:
        """Give the prefix cache the full pages of what this request computed."""
        if self.prefix_cache is None or req.num_computed_tokens == 0:
            return
        page_size = self.pool.page_size
        full = req.num_computed_tokens // page_size
        if full == 0:
            return
        pages = self.pool.pages_of(req.request_id)[:full]
        self.prefix_cache.insert(req.all_token_ids[: full * page_size], pages)

    def _release(self, req: Request) -> None:
        if req.cache_node is not None:
            self.prefix_cache.unlock(req.cache_node)
            req.cache_node = None
        self.pool.free(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._cache_computed(req)  # its recompute will mostly hit the cache
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make room for num_tokens tokens of req, evicting cache leaves if needed."""
        have = len(self.pool.pages_of(req.request_id)) * self.pool.page_size
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

        for req in list(self.running):
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.append(ScheduledSeq(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens))
            budget -= n

        can_admit = not preempted and (not self.static or not self.running)
        if can_admit:
            self._order_waiting()
        # Static batching admits a whole batch at once; its prefills then proceed chunk by chunk.
        while can_admit and self.waiting and len(self.running) < self.max_num_seqs:
            if budget <= 0 and not self.static:
                break
            req = self.waiting[0]
            if self._sibling_prefilling(req):
                break  # wait one step and take the sibling's prompt pages from the cache
            self._match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                self._release(req)
                req.num_computed_tokens = req.num_cached_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            if n > 0:
                scheduled.append(ScheduledSeq(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens))
                budget -= n

        if not scheduled:
            if self.running or self.waiting:
                if not self.running:
                    # Nothing runs and the head of the queue does not fit an empty pool: it never will.
                    raise OutOfPagesError(
                        f"request {self.waiting[0].request_id} needs more KV pages than the pool holds"
                    )
            return None
        # Decodes first, then prefill chunks (the ragged kernels expect that order).
        scheduled.sort(key=lambda s: s.num_tokens > 1)
        return self._build_plan(scheduled, preempted)

    def _sibling_prefilling(self, req: Request) -> bool:
        if self.prefix_cache is None or req.group_id is None:
            return False
        return any(r.group_id == req.group_id and r.num_computed_tokens < r.num_prompt_tokens for r in self.running)

    def _order_waiting(self) -> None:
        if self.policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time)))
        elif self.policy == "lpm" and self.prefix_cache is not None and len(self.waiting) > 1:
            hits = {id(r): self.prefix_cache.match_prefix(r.all_token_ids, max_tokens=r.num_tokens - 1, peek=True)[1]
                    for r in self.waiting}
            self.waiting = deque(sorted(self.waiting, key=lambda r: -hits[id(r)]))

    def _match_prefix(self, req: Request) -> None:
        if self.prefix_cache is None or req.num_computed_tokens > 0 or self.pool.pages_of(req.request_id):
            return
        pages, n, node = self.prefix_cache.match_prefix(req.all_token_ids, max_tokens=req.num_tokens - 1)
        if n == 0:
            return
        self.prefix_cache.lock(node)
        req.cache_node = node
        self.pool.append_shared(req.request_id, pages)
        req.num_computed_tokens = n
        if req.num_preemptions == 0:
            req.num_cached_tokens = n

    def _build_plan(self, scheduled: list[ScheduledSeq], preempted: list[Request]) -> StepPlan:
        page_size = self.pool.page_size
        num_tokens = sum(s.num_tokens for s in scheduled)
        max_pages = max(len(self.pool.pages_of(s.request.request_id)) for s in scheduled)
        T, S, P = self.buckets.pick(num_tokens, max_pages)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, NULL_PAGE * page_size, np.int32)  # padding writes into the null page
        kv_lens = np.zeros(S, np.int32)
        tables = np.full((S, P), NULL_PAGE, np.int32)
        cu = np.zeros(S + 1, np.int32)
        logits_idx = np.zeros(S, np.int32)
        samp = empty_sampling_arrays(S, self.history_len)
        off = 0
        for i, s in enumerate(scheduled):
            req, rid = s.request, s.request.request_id
            pages = np.asarray(self.pool.pages_of(rid), np.int32)
            ids = req.all_token_ids
            pos = np.arange(s.start, s.start + s.num_tokens, dtype=np.int32)
            tokens[off: off + s.num_tokens] = ids[s.start: s.start + s.num_tokens]
            positions[off: off + s.num_tokens] = pos
            slots[off: off + s.num_tokens] = pages[pos // page_size] * page_size + pos % page_size
            kv_lens[i] = s.start + s.num_tokens
            tables[i, : len(pages)] = pages
            off += s.num_tokens
            cu[i + 1] = off
            logits_idx[i] = off - 1
            self._fill_sampling(samp, i, req)
        cu[len(scheduled) + 1:] = off
        return StepPlan(
            seqs=scheduled, num_tokens=num_tokens, tokens=tokens, positions=positions, slot_mapping=slots,
            kv_lens=kv_lens, page_tables=tables, cu_q_lens=cu, num_seqs=np.asarray([len(scheduled)], np.int32),
            logits_indices=logits_idx, sampling=samp, preempted=preempted,
        )

    def _fill_sampling(self, samp: dict[str, np.ndarray], i: int, req: Request) -> None:
        p = req.params
        samp["temperature"][i] = p.temperature
        samp["top_k"][i] = p.top_k if p.top_k > 0 else 0
        samp["top_p"][i] = p.top_p
        samp["min_p"][i] = p.min_p
        samp["seeds"][i] = req.seed & 0xFFFFFFFF
        samp["steps"][i] = len(req.output_token_ids)
        samp["want_logprobs"][i] = p.logprobs is not None
        if p.uses_penalties:
            samp["repetition_penalty"][i] = p.repetition_penalty
            samp["presence_penalty"][i] = p.presence_penalty
            samp["frequency_penalty"][i] = p.frequency_penalty
            hist = req.all_token_ids[-self.history_len:]
            samp["history"][i, : len(hist)] = hist
            samp["prompt_lens"][i] = max(0, req.num_prompt_tokens - (req.num_tokens - len(hist)))
        if len(req.output_token_ids) < p.min_tokens:
            banned = ([] if p.ignore_eos else list(req.eos_token_ids)) + list(p.stop_token_ids)
            banned = banned[:MAX_BANNED]
            samp["banned"][i, : len(banned)] = banned

    # ---- after the device step --------------------------------------------------------------
    def update(self, plan: StepPlan, token_ids: np.ndarray, logprobs: tuple | None = None) -> list[tuple[Request, int]]:
        """Advance the scheduled sequences by the step's result; return (request, new token) pairs.
        Requests that hit a token-level stop are finished here and their pages freed."""
        new_tokens = []
        for i, s in enumerate(plan.seqs):
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = s.start + s.num_tokens
            if s.num_tokens > 1:
                # Share each prefill chunk's full pages at once: requests with the same beginning
                # (n > 1 siblings, a common system prompt) admitted next step reuse them.
                self._cache_computed(req)
            if not s.sample:
                continue
            tok = int(token_ids[i])
            req.output_token_ids.append(tok)
            if logprobs is not None and req.params.logprobs is not None:
                lp, top_ids, top_lp = logprobs
                k = req.params.logprobs
                req.output_logprobs.append((float(lp[i]), top_ids[i, :k].tolist(), top_lp[i, :k].tolist()))
            new_tokens.append((req, tok))
            if req.check_stop_token():
                self.finish(req, req.finish_reason)
        return new_tokens
