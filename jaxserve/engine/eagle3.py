"""Draft tokens from an EAGLE-3 head (speculative method "eagle3"; the head: jaxserve/models/eagle3.py).

The head drafts from the target's features, so it runs after every target step (`observe`): the
target runner keeps the residual streams entering three of its layers for every flat row
(`ModelRunner.last_aux`), and the head computes, in the step's own layout (same bucket, positions
and pages), position p from those features and token p + 1 for each position whose next token is
now known; the last such position of a request that is caught up gives its first draft. Before
the next target step (`prepare`) the head drafts on alone: position by position, its own output
state as the next input, for the requests the scheduler may give drafts to.

Its one-layer KV cache is laid out like the target's pool, page for page, and indexed by the
target's page tables: a page's head KV is written when the target computes the page, so pages the
prefix cache shares come with it, and nothing of the head needs freeing. The positions it drafts
past a request's computed tokens are in pages the request will compute next (reserved with the
scheduler's own allocation, `Scheduler.reserve`); the next `observe` overwrites them with the
verified tokens' values. Rows of finished requests and rejected drafts write to the null page.

Greedy drafts are point proposals: verification (accept a draft iff the target's own draw at its
position equals it) keeps the target's distribution whatever the head proposes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.attention import NULL_PAGE, AttentionMetadata, get_attention_fn, pool_layout, pool_shape, \
    with_pool_layout, write_kv
from jaxserve.cache.page_pool import PagePool
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.request import Request
from jaxserve.engine.runner import pack_step, packed_step_size, unpack_step
from jaxserve.engine.scheduler import StepPlan, ragged_layout
from jaxserve.models.eagle3 import Eagle3Head


class Eagle3Proposer:
    def __init__(self, head: Eagle3Head, pool: PagePool, buckets: Buckets, max_seqs: int, aux_dtype: Any,
                 attention_backend: str = "auto", mesh: Any = None):
        """aux_dtype: the dtype of the target runner's streams (its model's)."""
        self.pool = pool
        self.buckets = buckets
        self.max_seqs = max_seqs
        self.reserve: Callable[[Request, int], bool] = lambda req, n: False  # set to Scheduler.reserve
        acfg = head.cfg.attention_config()
        page_size = pool.page_size
        layout = pool_layout(attention_backend, acfg.head_dim, acfg.num_kv_heads, 1)
        shape = pool_shape(layout, 1, pool.num_pages, page_size, acfg.num_kv_heads, acfg.head_dim)[1:]
        attention_fn, kv_write_fn = with_pool_layout(get_attention_fn(attention_backend), write_kv, layout, page_size)
        self._rep = None
        if mesh is not None:  # (the head is small: replicated over the replica's devices)
            from jaxserve import parallel

            self._rep = parallel.replicated(mesh)
        self.kv_cache = jax.jit(lambda: jnp.zeros(shape, head.dtype), out_shardings=self._rep)()
        self.graphdef, self.state = nnx.split(head)
        if self._rep is not None:
            self.state = jax.device_put(self.state, self._rep)
        E, M = head.cfg.hidden_size, max_seqs

        def run(state, kv, packed, hidden, bucket):
            tokens, md, out_rows, _, src = unpack_step(packed, *bucket)
            m = nnx.merge(self.graphdef, state)
            hidden = hidden(m, src)
            prenorm, kv = m(tokens, hidden, md, kv, attention_fn, kv_write_fn)
            # Each sequence's output row, padded to max_seqs: the next draft step reads its states
            # by sequence index, whatever the bucket of the step that made them. Logits over the
            # draft vocabulary for those rows only.
            ids = jnp.zeros(M, jnp.int32).at[: bucket[1]].set(m.draft_ids(prenorm[out_rows]))
            states = jnp.zeros((M, E), prenorm.dtype).at[: bucket[1]].set(prenorm[out_rows])
            return kv, ids, states

        def catch_up(state, kv, packed, aux, *, bucket):
            """Positions the target computed: hidden inputs from its streams (`aux`, [T, 3 * E_t])."""
            return run(state, kv, packed, lambda m, src: m.combine(aux), bucket)

        def draft(state, kv, packed, states, *, bucket):
            """Drafted positions: row r's hidden input is the head's own state of sequence src[r]."""
            return run(state, kv, packed, lambda m, src: states[jnp.maximum(src, 0)], bucket)

        self._jits = {"catch_up": jax.jit(catch_up, donate_argnums=(1,), static_argnames=("bucket",)),
                      "draft": jax.jit(draft, donate_argnums=(1,), static_argnames=("bucket",))}
        self._compiled: dict[tuple[str, tuple[int, int, int]], Any] = {}
        self.hidden_size = E
        self.aux_width, self.aux_dtype = 3 * head.cfg.target_hidden_size, jnp.dtype(aux_dtype)
        self._first: dict[str, tuple[int, int]] = {}  # request id -> (first draft, its row of _states)
        self._states: Any = None  # the last catch-up's output states [max_seqs, E]
        self._drafts: dict[str, list[int]] = {}
        self.num_draft_steps = 0

    # ---- the DraftProposer interface ----------------------------------------------------------
    def propose(self, req: Request, limit: int) -> list[int]:
        return self._drafts.get(req.request_id, [])[:limit]

    def release(self, req: Request) -> None:
        self._first.pop(req.request_id, None)
        self._drafts.pop(req.request_id, None)

    # ---- after each target step ------------------------------------------------------------------
    def observe(self, plan: StepPlan, aux: Any) -> None:
        """Run the head over the target step `plan` just read (the scheduler has updated its
        requests), from the target's streams `aux` of that step."""
        T, S, _ = plan.bucket
        tokens = np.zeros(T, np.int32)
        slots = np.full(T, NULL_PAGE * self.pool.page_size, np.int32)
        out_rows = np.zeros(S, np.int32)
        ready = []
        for i, seq in enumerate(plan.seqs):
            req = seq.request
            if req.is_finished:
                continue
            # Position p needs token p + 1: known up to the request's last token.
            valid = min(seq.start + seq.num_tokens, req.num_tokens - 1) - seq.start
            if valid <= 0:
                continue
            rows = slice(seq.offset, seq.offset + valid)
            tokens[rows] = req.token_slice(seq.start + 1, seq.start + 1 + valid)
            slots[rows] = plan.slot_mapping[rows]
            out_rows[i] = seq.offset + valid - 1
            if seq.start + valid == req.num_tokens - 1:  # caught up: its last row gives a first draft
                ready.append((req.request_id, i))
        md = AttentionMetadata(plan.positions, slots, plan.kv_lens, plan.page_tables, plan.cu_q_lens, plan.num_seqs)
        none = np.full(T, -1, np.int32)
        packed = pack_step(tokens, md, out_rows, none, none)
        fn = self._compiled_fn("catch_up", plan.bucket)
        self.kv_cache, ids, self._states = fn(self.state, self.kv_cache, packed, aux)
        self.num_draft_steps += 1
        ids = np.asarray(ids)
        self._first = {rid: (int(ids[i]), i) for rid, i in ready}

    # ---- before the next ----------------------------------------------------------------------
    def prepare(self, wanted: list[tuple[Request, int]]) -> None:
        """Draft up to `limit` tokens for each (request, limit): what `propose` returns this step."""
        self._drafts = {}
        active = [(req, limit) for req, limit in wanted if req.request_id in self._first]
        for req, _ in active:
            self._drafts[req.request_id] = [self._first[req.request_id][0]]
        src = [self._first[req.request_id][1] for req, _ in active]
        states = self._states
        step = 1
        while True:
            # Draft j + 1 is the head's output at position num_tokens - 2 + j, which must be in
            # the request's pages (the ones its next target step computes).
            keep = [(req, limit, s) for (req, limit), s in zip(active, src)
                    if limit > step and self.reserve(req, req.num_tokens - 1 + step)]
            if not keep:
                return
            active, src = [(r, lim) for r, lim, _ in keep], [s for _, _, s in keep]
            n = len(active)
            starts = np.fromiter((req.num_tokens - 2 + step for req, _ in active), np.int32, n)
            lens = np.ones(n, np.int32)
            tables = [self.pool.table(req.request_id) for req, _ in active]
            bucket = self.buckets.pick(n, max(len(t) for t in tables))
            T, S, _ = bucket
            positions, slot_map, kv_lens, page_tables, cu = ragged_layout(starts, lens, tables, bucket,
                                                                          self.pool.page_size)
            tokens = np.zeros(T, np.int32)
            tokens[:n] = [self._drafts[req.request_id][-1] for req, _ in active]
            src_rows = np.full(T, -1, np.int32)
            src_rows[:n] = src
            out_rows = np.zeros(S, np.int32)
            out_rows[:n] = np.arange(n)
            md = AttentionMetadata(positions, slot_map, kv_lens, page_tables, cu, np.asarray([n], np.int32))
            packed = pack_step(tokens, md, out_rows, np.full(T, -1, np.int32), src_rows)
            fn = self._compiled_fn("draft", bucket)
            self.kv_cache, ids, states = fn(self.state, self.kv_cache, packed, states)
            self.num_draft_steps += 1
            ids = np.asarray(ids)
            for i, (req, _) in enumerate(active):
                self._drafts[req.request_id].append(int(ids[i]))
            src = list(range(n))
            step += 1

    def _compiled_fn(self, kind: str, bucket: tuple[int, int, int]) -> Any:
        """The compiled catch-up or draft step of a bucket (compiled ahead by `warmup`)."""
        key = (kind, bucket)
        if key not in self._compiled:
            rep = self._rep
            i32 = jax.ShapeDtypeStruct((packed_step_size(*bucket),), jnp.int32, sharding=rep)
            kv = jax.ShapeDtypeStruct(self.kv_cache.shape, self.kv_cache.dtype, sharding=self.kv_cache.sharding)
            if kind == "catch_up":
                extra = jax.ShapeDtypeStruct((bucket[0], self.aux_width), self.aux_dtype, sharding=rep)
            else:
                extra = jax.ShapeDtypeStruct((self.max_seqs, self.hidden_size), self.kv_cache.dtype, sharding=rep)
            self._compiled[key] = self._jits[kind].lower(self.state, kv, i32, extra, bucket=bucket).compile()
        return self._compiled[key]

    def warmup(self, buckets: list[tuple[int, int, int]], show_progress: bool = True) -> None:
        """Compile the catch-up and the draft step of every bucket."""
        for bucket in tqdm(buckets, desc="compiling the EAGLE-3 head", unit="bucket", disable=not show_progress,
                           leave=False):
            self._compiled_fn("catch_up", bucket)
            self._compiled_fn("draft", bucket)

    def check_invariants(self) -> None:
        for rid, (_, row) in self._first.items():
            assert 0 <= row < self.max_seqs, rid
