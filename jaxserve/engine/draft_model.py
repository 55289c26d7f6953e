"""Draft tokens from a smaller model with the target's tokenizer (speculative method "draft_model").

The draft model runs on a ModelRunner and page pool of its own, never touching the target's. Before
each step the engine hands it the requests that may draft (`prepare`): the draft first catches up
with each request's tokens (its prompt once, then the tokens accepted since the last step: one
ragged step for all of them), then draws greedily one token per request per step, k steps for k
drafts. `propose` then returns them to the scheduler like any other source's.

The draft cache is kept per position: `_cached[id]` lists the tokens whose K/V the draft pool
holds for that request, in order. Drafts that verification rejected differ from the request's
tokens at their positions; the cache is cut back to the common prefix before the next catch-up,
so the draft recomputes only what changed. A request the draft pool cannot hold gets no drafts
(the pool is as large as the target's in pages, so that is rare).

Greedy drafts are point proposals: the verification rule (accept a draft iff the target's own
draw at its position equals it) keeps the target's distribution whatever the draft proposes.
"""

from __future__ import annotations

import numpy as np

from jaxserve.cache.page_pool import OutOfPagesError, PagePool
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.request import Request
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.sampler import empty_sampling_arrays
from jaxserve.engine.scheduler import StepPlan, ragged_layout

class DraftModelProposer:
    def __init__(self, runner: ModelRunner, pool: PagePool, buckets: Buckets, max_num_batched_tokens: int,
                 history_len: int):
        self.runner = runner
        self.pool = pool
        self.buckets = buckets
        self.token_budget = max_num_batched_tokens
        self.history_len = history_len
        self._cached: dict[str, list[int]] = {}  # request id -> tokens held in the draft cache
        self._known: dict[str, int] = {}  # request id -> how many of those are the request's own
        self._drafts: dict[str, list[int]] = {}  # this step's drafts, by request id
        self.num_draft_steps = 0  # device steps of the draft model (catch-up and drafting)

    # ---- the DraftProposer interface ----------------------------------------------------------
    def propose(self, req: Request, limit: int) -> list[int]:
        return self._drafts.get(req.request_id, [])[:limit]

    def release(self, req: Request) -> None:
        self._forget(req.request_id)

    # ---- drafting --------------------------------------------------------------------------------
    def prepare(self, wanted: list[tuple[Request, int]]) -> None:
        """Draft up to `limit` tokens for each (request, limit): what `propose` returns this step."""
        self._drafts = {}
        active = self._catch_up(wanted)
        for req, _, drafts in active:
            self._drafts[req.request_id] = drafts
        while True:
            # Each request short of its limit feeds its last draft and draws the next one.
            active = [(req, limit, drafts) for req, limit, drafts in active
                      if len(drafts) < limit and self._hold(req.request_id, req.num_tokens + len(drafts))]
            if not active:
                return
            entries = []
            for req, _, drafts in active:
                cached = self._cached[req.request_id]
                entries.append((req.request_id, len(cached), [drafts[-1]]))
                cached.append(drafts[-1])
            for (_, _, drafts), tok in zip(active, self._run(entries)):
                drafts.append(int(tok))

    def _catch_up(self, wanted: list[tuple[Request, int]]) -> list[tuple[Request, int, list[int]]]:
        """Feed each request's tokens that the draft cache lacks, up to the step's token budget, and
        draw each caught-up request's first draft: [(request, limit, [first draft])]."""
        entries, ready = [], []
        budget = self.token_budget
        for req, limit in wanted:
            if budget <= 0:
                break
            rid = req.request_id
            cached = self._cached.setdefault(rid, [])
            # Past the tokens known to be the request's own, the cache holds last step's drafts:
            # keep those verification accepted, recompute from the first rejected one. The last
            # token is always fed again: its logits give the first draft.
            end = min(len(cached), req.num_tokens - 1)
            known = min(self._known.get(rid, 0), end)
            keep = known + _common_prefix(cached[known:end], req.token_slice(known, end))
            del cached[keep:]
            n = min(req.num_tokens - keep, budget)
            if not self._hold(rid, keep + n):
                continue
            tokens = req.token_slice(keep, keep + n)
            cached.extend(tokens)
            self._known[rid] = keep + n
            entries.append((rid, keep, tokens))
            budget -= n
            if keep + n == req.num_tokens:
                ready.append((req, limit))
        if not entries:
            return []
        first = {rid: int(tok) for (rid, _, _), tok in zip(entries, self._run(entries))}
        return [(req, limit, [first[req.request_id]]) for req, limit in ready]

    def _hold(self, rid: str, num_tokens: int) -> bool:
        """Grow the request's draft pages to hold num_tokens; on a full pool, drop the request
        from the draft cache (it gets no drafts until pages free up)."""
        try:
            self.pool.ensure_capacity(rid, num_tokens)
            return True
        except OutOfPagesError:
            self._forget(rid)
            return False

    def _forget(self, rid: str) -> None:
        self.pool.free(rid)
        self._cached.pop(rid, None)
        self._known.pop(rid, None)
        self._drafts.pop(rid, None)

    def _run(self, entries: list[tuple[str, int, list[int]]]) -> np.ndarray:
        """One greedy step of the draft model over (request id, start position, tokens) chunks;
        returns the token drawn after each chunk's last one."""
        n = len(entries)
        num_tokens = sum(len(t) for _, _, t in entries)
        max_pages = max(self.pool.num_pages_held(rid) for rid, _, _ in entries)
        bucket = self.buckets.pick(num_tokens, max_pages)
        T, S, P = bucket
        starts = np.fromiter((s for _, s, _ in entries), np.int32, n)
        lens = np.fromiter((len(t) for _, _, t in entries), np.int32, n)
        rows = [self.pool.table(rid) for rid, _, _ in entries]
        positions, slots, kv_lens, tables, cu = ragged_layout(starts, lens, rows, bucket, self.pool.page_size)
        tokens = np.zeros(T, np.int32)
        tokens[:num_tokens] = [t for _, _, chunk in entries for t in chunk]
        logits_idx = np.zeros(S, np.int32)
        logits_idx[:n] = cu[1: n + 1] - 1
        # Neutral sampling values: temperature 0, greedy.
        samp = empty_sampling_arrays(S, self.history_len, with_history=False, with_logit_bias=False)
        plan = StepPlan(seqs=[], num_tokens=num_tokens, tokens=tokens, positions=positions, slot_mapping=slots,
                        kv_lens=kv_lens, page_tables=tables, cu_q_lens=cu, num_seqs=np.asarray([n], np.int32),
                        logits_indices=logits_idx, sampling=samp)
        token_ids, _ = self.runner.fetch(self.runner.launch(plan), with_logprobs=False)
        self.num_draft_steps += 1
        return token_ids[:n]

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        for rid, cached in self._cached.items():
            assert len(cached) <= self.pool.num_pages_held(rid) * self.pool.page_size, rid

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)


def _common_prefix(a: list[int], b: list[int]) -> int:
    i, n = 0, min(len(a), len(b))
    while i < n and a[i] == b[i]:
        i += 1
    return i
