"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same contract as ``jaxserve.attention.ragged_paged_attention_xla``: one flat batch of query tokens
mixing decodes and prefill chunks, KV pool ``[num_pages, page_size, 2 * kv_heads, head_dim]`` with K
of kv head h at 2h and V at 2h+1.

Design
  * Queries are regrouped outside the kernel to ``[kv_heads, tokens * group, head_dim]``: row
    ``t * group + g`` is query head ``h * group + g`` of token t. One MXU matmul then serves a whole
    GQA group, and a q block is a plain rectangular BlockSpec tile.
  * Grid ``(kv head blocks, query blocks)``; both axes are independent ("parallel", so megacore
    chips split them). A query block of ``block_q`` tokens may hold the tail of one
    sequence, several whole decodes and the head of another: the kernel walks the sequences that
    intersect the block, and for each one the KV blocks its rows can see (causal upper bound,
    sliding-window lower bound), with an online softmax whose state lives in VMEM scratch.
  * Page tables, kv_lens, cu_q_lens, num_seqs and each query block's first sequence are scalar
    prefetch (SMEM). The pool stays in HBM (``memory_space=ANY``); every KV block is
    ``pages_per_block`` page DMAs into one of two VMEM buffers. While block i is computed,
    block i+1 (possibly the first block of the next sequence) is already in flight.
  * Pages no row needs are not fetched; the stale VMEM they leave is masked out, and V is zeroed
    outside the valid range so that garbage (even NaN) in unused slots cannot leak through 0 * NaN.
  * Why whole head blocks are DMA'd and K/V split in VMEM: the pool's minor dims [2*KVH, D] are
    tiled in HBM, and Mosaic only lets a DMA slice/squeeze a tiled dim at tile granularity
    ("All tiled squeezed dimensions must be of size 1"), so a per-head ``at[page, :, 2h, :]`` copy
    does not compile for real layouts. A whole tile of combined heads (or all of them) does, and
    one DMA per page then brings K and V together, which is what the interleaved layout is for.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Moved between jax versions: memory space ANY lives on pl (new) or pltpu (old); the compiler
# params class was TPUCompilerParams before CompilerParams.
_ANY = getattr(pl, "ANY", None) or getattr(pltpu, "ANY")
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")

_LANES = 128  # m/l scratch is lane-replicated: Mosaic handles [R, 128] tiles, not [R, 1] ones

# (block_q tokens, KV tokens per block) by device kind; kv tokens are turned into pages.
# Starting points from the roofline (bigger KV blocks amortize the per-block DMA/loop overhead on
# chips with more VMEM bandwidth); not tuned on hardware.
_DEFAULT_BLOCKS: dict[str, tuple[int, int]] = {
    "v4": (32, 256),
    "v5 lite": (32, 256),  # v5e reports "TPU v5 lite"
    "v5e": (32, 256),
    "v5p": (32, 512),
    "v5": (32, 512),
    "v6": (32, 512),  # v6e reports "TPU v6 lite"
    "tpu7": (32, 512),  # "TPU7x"
}
_FALLBACK_BLOCKS = (32, 256)
_INTERPRET_BLOCKS = (8, 32)  # the TPU interpreter simulates every DMA and op: keep blocks small
_VMEM_KV_BUDGET = 8 * 1024 * 1024  # bytes for the two KV buffers; well under every chip's scoped VMEM


def default_block_sizes(page_size: int, interpret: bool = False) -> tuple[int, int]:
    """(block_q tokens, pages_per_block) for this device kind (small ones in interpret mode)."""
    if interpret:
        num_q, kv_tokens = _INTERPRET_BLOCKS
    else:
        kind = jax.devices()[0].device_kind.lower()
        num_q, kv_tokens = _FALLBACK_BLOCKS
        for key in sorted(_DEFAULT_BLOCKS, key=len, reverse=True):  # most specific key first
            if key in kind:
                num_q, kv_tokens = _DEFAULT_BLOCKS[key]
                break
    return num_q, max(1, kv_tokens // page_size)


def _sublane_packing(dtype: jnp.dtype) -> int:
    return 4 // jnp.dtype(dtype).itemsize


def _kv_heads_per_block(kv_heads: int, dtype: jnp.dtype) -> int:
    """KV heads per grid step: a full sublane tile of combined K/V heads if they divide, else all.

    The VMEM buffer [pages, page_size, 2*kvh_blk, D] is viewed as [pages*page_size*2*kvh_blk, D]
    for the strided K/V loads; that view is free only when the combined-head axis fills whole
    sublane tiles (or is the whole, small, axis)."""
    tile = 8 * _sublane_packing(dtype)
    if (2 * kv_heads) % tile == 0:
        return tile // 2
    return kv_heads


def _regroup_queries(q: jax.Array, kv_heads: int, num_tokens_padded: int) -> jax.Array:
    """[T, H, D] -> [KVH, T_pad * G, D] with row t*G + g = head kvh*G + g of token t."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // kv_heads
    q = jnp.pad(q, ((0, num_tokens_padded - num_tokens), (0, 0), (0, 0)))
    q = q.reshape(num_tokens_padded, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    return q.reshape(kv_heads, num_tokens_padded * group, head_dim)


def _ungroup_output(o: jax.Array, num_tokens: int, num_heads: int) -> jax.Array:
    kv_heads, rows, head_dim = o.shape
    group = num_heads // kv_heads
    o = o.reshape(kv_heads, rows // group, group, head_dim).transpose(1, 0, 2, 3)
    return o.reshape(rows // group, num_heads, head_dim)[:num_tokens]


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S]
    page_tables_ref,  # [S * P] flattened: 2-D SMEM arrays pad their minor dim
    cu_q_lens_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    first_seq_ref,  # [num_q_blocks] first sequence with a token in each query block
    # inputs
    q_ref,  # VMEM [kvh_blk, R, D], R = block_q * group
    kv_hbm_ref,  # HBM [N, page_size, 2*KVH, D]
    # outputs
    o_ref,  # VMEM [kvh_blk, R, D]
    # scratch
    kv_buf,  # VMEM [2, pages_per_blk, page_size, 2*kvh_blk, D]
    sems,  # DMA semaphores [2]
    m_ref,  # VMEM f32 [kvh_blk, R, 128] running max, lane-replicated
    l_ref,  # VMEM f32 [kvh_blk, R, 128] running denominator
    acc_ref,  # VMEM f32 [kvh_blk, R, D] running numerator
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    max_seqs: int,
    pages_per_seq: int,
    kv_split: str,
):
    kvh_blk, rows, head_dim = q_ref.shape
    _, pages_per_blk, page_size, combined_blk, _ = kv_buf.shape
    kv_per_blk = pages_per_blk * page_size
    tokens_per_blk = rows // group
    if combined_blk == kv_hbm_ref.shape[2]:
        head_start = 0  # one head block: a static offset needs no alignment proof
    else:  # a whole number of sublane tiles; Mosaic must be told so to accept the DMA slice
        head_start = pl.multiple_of(pl.program_id(0) * combined_blk, combined_blk)
    q_blk = pl.program_id(1)
    tok_lo = q_blk * tokens_per_blk
    tok_hi = tok_lo + tokens_per_blk
    num_seqs = jnp.minimum(num_seqs_ref[0], max_seqs)
    packed = jnp.dtype(kv_buf.dtype).itemsize == 2
    f32_inputs = jnp.dtype(q_ref.dtype) == jnp.float32

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_live(seq):
        """Sequence `seq` is real and starts before this query block ends."""
        seq_c = jnp.minimum(seq, max_seqs - 1)
        return (seq < num_seqs) & (cu_q_lens_ref[seq_c] < tok_hi)

    def seq_span(seq):
        """KV range [kv_lo, kv_hi) that the rows of `seq` inside this query block attend to."""
        seq_c = jnp.minimum(seq, max_seqs - 1)
        q_start = cu_q_lens_ref[seq_c]
        q_end = cu_q_lens_ref[seq_c + 1]
        kv_len = kv_lens_ref[seq_c]
        first_tok = jnp.maximum(q_start, tok_lo)
        last_tok = jnp.minimum(q_end, tok_hi) - 1
        offset = kv_len - (q_end - q_start) - q_start  # query token t sits at KV position t + offset
        kv_hi = jnp.minimum(kv_len, last_tok + offset + 1)
        kv_lo = jnp.int32(0)
        if sliding_window is not None:
            kv_lo = jnp.maximum(0, first_tok + offset - sliding_window + 1)
        nonempty = (first_tok <= last_tok) & (kv_hi > kv_lo)
        blk_lo = kv_lo // kv_per_blk
        blk_hi = jnp.where(nonempty, (kv_hi + kv_per_blk - 1) // kv_per_blk, blk_lo)
        return dict(q_start=q_start, q_end=q_end, offset=offset, kv_lo=kv_lo, kv_hi=kv_hi,
                    blk_lo=blk_lo, blk_hi=blk_hi, seq_c=seq_c)

    def page_copies(span, blk, slot):
        """(needed, descriptor) per page of KV block `blk`; pages outside [kv_lo, kv_hi) are skipped."""
        copies = []
        for i in range(pages_per_blk):
            page_in_seq = blk * pages_per_blk + i
            needed = ((page_in_seq * page_size < span["kv_hi"])
                      & ((page_in_seq + 1) * page_size > span["kv_lo"])
                      & (page_in_seq < pages_per_seq))
            table_idx = span["seq_c"] * pages_per_seq + jnp.minimum(page_in_seq, pages_per_seq - 1)
            page = page_tables_ref[table_idx]
            src = kv_hbm_ref.at[page, :, pl.ds(head_start, combined_blk), :]
            copies.append((needed, pltpu.make_async_copy(src, kv_buf.at[slot, i], sems.at[slot])))
        return copies

    def start_block(span, blk, slot):
        for needed, copy in page_copies(span, blk, slot):
            pl.when(needed)(copy.start)

    def wait_block(span, blk, slot):
        for needed, copy in page_copies(span, blk, slot):
            pl.when(needed)(copy.wait)

    def load_kv(slot, h):
        """K and V of kv head h of the KV block in buffer `slot`, each [kv_per_blk, D]."""
        if kv_split == "indexed":
            # Plain indexing on the combined-head axis: what the TPU interpreter supports (it has
            # no ref reshape/bitcast), and a fallback for Mosaic versions that reject the below.
            k = kv_buf[slot, :, :, 2 * h, :].reshape(kv_per_blk, head_dim)
            v = kv_buf[slot, :, :, 2 * h + 1, :].reshape(kv_per_blk, head_dim)
            return k, v
        # View the buffer as rows [kv_per_blk * combined_blk, D] (free: the combined-head axis
        # fills whole sublane tiles) and pick K/V rows with sublane-strided loads.
        flat = kv_buf.at[slot].reshape(kv_per_blk * combined_blk, head_dim)
        if not packed:
            k = flat[pl.ds(2 * h, kv_per_blk, stride=combined_blk), :]
            v = flat[pl.ds(2 * h + 1, kv_per_blk, stride=combined_blk), :]
            return k, v
        # A 16-bit K row and its V row share one 32-bit sublane word (K low, V high): load the
        # words with a 32-bit strided load and split them; Mosaic has no strided packed loads.
        words = flat.bitcast(jnp.uint32)
        kv_heads_blk = combined_blk // 2
        if kv_heads_blk == 1:
            w = words[...]
        else:
            w = words[pl.ds(h, kv_per_blk, stride=kv_heads_blk), :]
        k = pltpu.bitcast(w << 16, jnp.float32).astype(kv_buf.dtype)
        v = pltpu.bitcast(w & jnp.uint32(0xFFFF0000), jnp.float32).astype(kv_buf.dtype)
        return k, v

    def compute_block(span, blk, slot):
        kv_start = blk * kv_per_blk
        shape = (rows, kv_per_blk)
        row_tok = tok_lo + lax.broadcasted_iota(jnp.int32, shape, 0) // group
        col_pos = kv_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        row_pos = row_tok + span["offset"]
        in_seq = (row_tok >= span["q_start"]) & (row_tok < span["q_end"])
        mask = in_seq & (col_pos <= row_pos) & (col_pos < span["kv_hi"])
        if sliding_window is not None:
            mask &= col_pos > row_pos - sliding_window
        row_tok_l = tok_lo + lax.broadcasted_iota(jnp.int32, (rows, _LANES), 0) // group
        update_l = (row_tok_l >= span["q_start"]) & (row_tok_l < span["q_end"])
        row_tok_d = tok_lo + lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) // group
        update_d = (row_tok_d >= span["q_start"]) & (row_tok_d < span["q_end"])
        v_pos = kv_start + lax.broadcasted_iota(jnp.int32, (kv_per_blk, head_dim), 0)
        v_valid = (v_pos >= span["kv_lo"]) & (v_pos < span["kv_hi"])
        precision = lax.Precision.HIGHEST if f32_inputs else None

        for h in range(kvh_blk):
            k, v = load_kv(slot, h)
            q = q_ref[h]
            k = k.astype(q.dtype)
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, -jnp.inf)
            m_prev = jnp.max(m_ref[h], axis=1, keepdims=True)
            l_prev = jnp.max(l_ref[h], axis=1, keepdims=True)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing to see yet
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            v = jnp.where(v_valid, v.astype(jnp.float32), 0.0).astype(v.dtype)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
            # Only this sequence's rows move; the rest of the block belongs to other sequences.
            m_ref[h] = jnp.where(update_l, jnp.broadcast_to(m_new, (rows, _LANES)), m_ref[h])
            l_ref[h] = jnp.where(update_l, jnp.broadcast_to(l_new, (rows, _LANES)), l_ref[h])
            acc_ref[h] = jnp.where(update_d, alpha * acc_ref[h] + pv, acc_ref[h])

    def seq_cond(carry):
        seq, _, _ = carry
        return seq_live(seq)

    def seq_body(carry):
        seq, slot, pending = carry
        span = seq_span(seq)
        has_blocks = span["blk_hi"] > span["blk_lo"]

        @pl.when(has_blocks & (pending == 0))
        def _():
            start_block(span, span["blk_lo"], slot)

        nxt = seq + 1
        nxt_span = seq_span(nxt)
        prefetch_next = seq_live(nxt) & (nxt_span["blk_hi"] > nxt_span["blk_lo"])

        def kv_body(blk, slot):
            last = blk + 1 == span["blk_hi"]

            @pl.when(jnp.logical_not(last))
            def _():
                start_block(span, blk + 1, 1 - slot)

            @pl.when(last & prefetch_next)
            def _():  # keep the DMA engine busy across the sequence boundary
                start_block(nxt_span, nxt_span["blk_lo"], 1 - slot)

            wait_block(span, blk, slot)
            compute_block(span, blk, slot)
            return 1 - slot

        slot = lax.fori_loop(span["blk_lo"], span["blk_hi"], kv_body, slot)
        pending = (has_blocks & prefetch_next).astype(jnp.int32)
        return nxt, slot, pending

    lax.while_loop(seq_cond, seq_body, (first_seq_ref[q_blk], jnp.int32(0), jnp.int32(0)))

    for h in range(kvh_blk):
        l = jnp.max(l_ref[h], axis=1, keepdims=True)
        out = acc_ref[h] / jnp.where(l > 0.0, l, 1.0)
        o_ref[h] = jnp.where(l > 0.0, out, 0.0).astype(o_ref.dtype)


def q_block_seq_ranges(cu_q_lens: jax.Array, num_q_blocks: int, block_q: int) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) of the sequences whose query rows intersect each q block of ``block_q`` rows."""
    ends = cu_q_lens[1:]
    r0 = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    lo = jnp.searchsorted(ends, r0, side="right").astype(jnp.int32)
    hi = jnp.searchsorted(ends, r0 + block_q - 1, side="right").astype(jnp.int32) + 1
    n = ends.shape[0]
    return jnp.minimum(lo, n), jnp.minimum(hi, n)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q",
                     "pages_per_block", "vmem_limit_bytes", "kv_split", "interpret"),
)
def ragged_paged_attention_tpu(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    kv_split: str | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Ragged paged attention on TPU. q: [T, H, D] -> [T, H, D]; padding rows give zeros.

    block_q: query tokens per grid step (rounded up to the sublane tile).
    pages_per_block: pages per KV block (one DMA each, double-buffered).
    kv_split: how K/V rows are picked out of a DMA'd block of combined heads: "strided"
      (sublane-strided loads, the default on TPU) or "indexed" (plain indexing; the only one the
      TPU interpreter runs, so the default in interpret mode).
    interpret: True or a ``pltpu.InterpretParams`` runs the kernel in TPU interpret mode (CPU).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, combined, head_dim_kv = kv_pages.shape
    max_seqs, pages_per_seq = page_tables.shape
    kv_heads = combined // 2
    if combined % 2 or num_heads % kv_heads or head_dim_kv != head_dim:
        raise ValueError(f"incompatible shapes q={q.shape} kv_pages={kv_pages.shape}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    group = num_heads // kv_heads
    kv_split = kv_split or ("indexed" if interpret else "strided")
    if kv_split not in ("strided", "indexed"):
        raise ValueError(f"kv_split must be 'strided' or 'indexed', got {kv_split!r}")

    default_q, default_pages = default_block_sizes(page_size, bool(interpret))
    q_per_blk = block_q or default_q
    pages_per_blk = pages_per_block or default_pages
    pages_per_blk = max(1, min(pages_per_blk, pages_per_seq))
    kvh_blk = _kv_heads_per_block(kv_heads, kv_pages.dtype)
    buf_bytes = 2 * pages_per_blk * page_size * 2 * kvh_blk * head_dim * kv_pages.dtype.itemsize
    while pages_per_blk > 1 and buf_bytes > _VMEM_KV_BUDGET:
        pages_per_blk //= 2
        buf_bytes //= 2
    # Rows of a q tile must fill sublane tiles: make tokens-per-block a multiple of the tile.
    tile = 8 * _sublane_packing(q.dtype)
    q_per_blk = min(q_per_blk, -(-num_tokens // 8) * 8)
    q_per_blk = -(-q_per_blk // tile) * tile
    num_q_blocks = -(-num_tokens // q_per_blk)
    num_tokens_padded = num_q_blocks * q_per_blk
    rows = q_per_blk * group

    q_grouped = _regroup_queries(q, kv_heads, num_tokens_padded)
    # Clamp page ids: a bad table entry must not become an out-of-bounds DMA.
    tables = jnp.clip(page_tables.astype(jnp.int32), 0, num_pages - 1).reshape(-1)
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    num_seqs = num_seqs.astype(jnp.int32).reshape(1)
    first_seq, _ = q_block_seq_ranges(cu_q_lens, num_q_blocks, q_per_blk)

    q_spec = pl.BlockSpec((kvh_blk, rows, head_dim), lambda hb, qb, *_: (hb, qb, 0))
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), group=group, max_seqs=max_seqs,
        pages_per_seq=pages_per_seq, kv_split=kv_split)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(kv_heads // kvh_blk, num_q_blocks),
            in_specs=[q_spec, pl.BlockSpec(memory_space=_ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_blk, page_size, 2 * kvh_blk, head_dim), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((kvh_blk, rows, _LANES), jnp.float32),
                pltpu.VMEM((kvh_blk, rows, _LANES), jnp.float32),
                pltpu.VMEM((kvh_blk, rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_grouped.shape, q.dtype),
        compiler_params=_CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret or False,
        name="ragged_paged_attention_tpu",
    )(kv_lens, tables, cu_q_lens, num_seqs, first_seq, q_grouped, kv_pages)
    return _ungroup_output(out, num_tokens, num_heads)
