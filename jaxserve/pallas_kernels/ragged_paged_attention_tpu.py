"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same inputs and semantics as ``jaxserve.attention.ragged_paged_attention_xla``.

Design (kept simple on purpose):
  * q is viewed head-major, [H, T, D], so one grid step reads a clean [group, block_q, D] tile: the
    ``group`` query heads sharing one KV head, for ``block_q`` consecutive flat query rows.
  * grid = (kv_heads, T / block_q). A q block can span several sequences (many decodes, or the
    seam between two prefill chunks); the step loops over exactly those sequences (their range is
    precomputed per q block and passed as scalar prefetch) and keeps a per-row online softmax in
    VMEM scratch. Rows of other sequences are masked to -inf, which leaves their state untouched,
    so one accumulator serves all sequences of the block and is normalised once at the end.
  * For each sequence, only the KV blocks its rows of this q block can see (causal upper bound,
    sliding-window lower bound) are visited. K and V of this KV head are DMA'd page by page from
    the pool in HBM (memory_space ANY) into a 2-slot VMEM buffer: block j+1 is in flight while
    block j is computed.
  * kv_lens / page tables / cu_q_lens / per-q-block sequence ranges / num_seqs are scalar
    prefetch (SMEM). The page table is flattened to 1D so SMEM does not pad a 2D array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Moved between jax versions: memory space ANY lives on pl (new) or pltpu (old).
_ANY = getattr(pl, "ANY", None) or getattr(pltpu, "ANY")
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")

_LANES = 128  # m / l scratch is lane-broadcast: Mosaic dislikes [rows, 1] VMEM slices

# (block_q rows, KV tokens per block) by device kind prefix; untuned starting points.
_DEFAULT_BLOCKS: dict[str, tuple[int, int]] = {
    "TPU v6": (64, 512),
    "TPU v5 lite": (32, 256),
    "TPU v5e": (32, 256),
    "TPU v5": (32, 512),
    "TPU v4": (32, 256),
}
_FALLBACK_BLOCKS = (32, 256)
_INTERPRET_BLOCKS = (8, 32)  # small: the TPU interpreter simulates every DMA and op


def default_block_sizes(page_size: int, interpret: bool = False) -> tuple[int, int]:
    """(block_q, pages_per_block) for this device kind."""
    if interpret:
        bq, kv_tokens = _INTERPRET_BLOCKS
    else:
        kind = jax.devices()[0].device_kind
        bq, kv_tokens = next((v for k, v in _DEFAULT_BLOCKS.items() if kind.startswith(k)), _FALLBACK_BLOCKS)
    return bq, max(1, kv_tokens // page_size)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref, page_table_ref, cu_q_lens_ref, seq_lo_ref, seq_hi_ref, num_seqs_ref,
    # inputs
    q_ref,        # VMEM [G, bq, D]
    kv_hbm_ref,   # HBM  [N, page_size, 2*KVH, D]
    # outputs
    o_ref,        # VMEM [G, bq, D]
    # scratch
    k_buf, v_buf,  # VMEM [2, ppb, page_size, D]
    sems,          # DMA semaphores [2]
    m_ref, l_ref,  # VMEM f32 [G, bq, 128]
    acc_ref,       # VMEM f32 [G, bq, D]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_seq: int,
    precision,
):
    kvh = pl.program_id(0)
    qb = pl.program_id(1)
    group, bq, head_dim = q_ref.shape
    _, ppb, page_size, _ = k_buf.shape
    bk = ppb * page_size
    r0 = qb * bq

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def page_copies(seq, blk, slot, n_pages):
        # One DMA per page for K and one for V of this KV head. Pages past the sequence's end
        # (possibly garbage ids in a bucketed table) are redirected to the null page: never OOB.
        copies = []
        for i in range(ppb):
            col = blk * ppb + i
            page = jnp.where(col < n_pages,
                             page_table_ref[seq * pages_per_seq + jnp.minimum(col, pages_per_seq - 1)], 0)
            copies.append(pltpu.make_async_copy(kv_hbm_ref.at[page, :, 2 * kvh, :], k_buf.at[slot, i], sems.at[slot]))
            copies.append(pltpu.make_async_copy(kv_hbm_ref.at[page, :, 2 * kvh + 1, :], v_buf.at[slot, i], sems.at[slot]))
        return copies

    def seq_body(seq, carry):
        kv_len = kv_lens_ref[seq]
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        q_len = q_end - q_start
        a = jnp.maximum(q_start, r0)          # this sequence's rows in this q block: [a, b)
        b = jnp.minimum(q_end, r0 + bq)
        first_pos = kv_len - q_len + (a - q_start)
        last_pos = kv_len - q_len + (b - 1 - q_start)
        hi = jnp.minimum(last_pos + 1, kv_len)
        lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        blk_lo = lo // bk
        blk_hi = jnp.where((a < b) & (hi > 0), (hi + bk - 1) // bk, blk_lo)
        blk_hi = jnp.maximum(blk_hi, blk_lo)
        n_pages = (kv_len + page_size - 1) // page_size

        @pl.when(blk_hi > blk_lo)
        def _():
            for c in page_copies(seq, blk_lo, 0, n_pages):
                c.start()

        rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        in_seq = (rows >= a) & (rows < b)
        q_pos = kv_len - q_len + (rows - q_start)

        def kv_body(j, carry):
            slot = (j - blk_lo) % 2

            @pl.when(j + 1 < blk_hi)
            def _():
                for c in page_copies(seq, j + 1, 1 - slot, n_pages):
                    c.start()

            for c in page_copies(seq, j, slot, n_pages):
                c.wait()
            k = k_buf[slot].reshape(bk, head_dim)
            v = v_buf[slot].reshape(bk, head_dim)
            cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
            mask = in_seq & (cols < kv_len) & (cols <= q_pos)
            if sliding_window is not None:
                mask = mask & (cols > q_pos - sliding_window)
            # Zero V slots past the sequence end so stale non-finite data cannot leak via 0*inf.
            v_ok = (j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, head_dim), 0)) < kv_len
            v = jnp.where(v_ok, v, jnp.zeros_like(v))
            for g in range(group):
                q = (q_ref[g].astype(jnp.float32) * sm_scale).astype(k.dtype)
                s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32, precision=precision)
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(mask, s, -jnp.inf)
                m_prev = m_ref[g][:, :1]
                m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(s - m_safe)
                alpha = jnp.exp(m_prev - m_safe)
                l_new = l_ref[g][:, :1] * alpha + p.sum(axis=-1, keepdims=True)
                pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32, precision=precision)
                acc_ref[g] = acc_ref[g] * alpha + pv
                m_ref[g] = jnp.broadcast_to(m_new, (bq, _LANES))
                l_ref[g] = jnp.broadcast_to(l_new, (bq, _LANES))
            return carry

        jax.lax.fori_loop(blk_lo, blk_hi, kv_body, 0)
        return carry

    seq_hi = jnp.minimum(seq_hi_ref[qb], num_seqs_ref[0])
    jax.lax.fori_loop(seq_lo_ref[qb], seq_hi, seq_body, 0)

    for g in range(group):
        l = l_ref[g][:, :1]
        o_ref[g] = (acc_ref[g] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def q_block_seq_ranges(cu_q_lens: jax.Array, num_q_blocks: int, block_q: int) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) of the sequences whose query rows intersect each q block of ``block_q`` rows."""
    ends = cu_q_lens[1:]
    r0 = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    lo = jnp.searchsorted(ends, r0, side="right").astype(jnp.int32)
    hi = jnp.searchsorted(ends, r0 + block_q - 1, side="right").astype(jnp.int32) + 1
    n = ends.shape[0]
    return jnp.minimum(lo, n), jnp.minimum(hi, n)


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
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention, Mosaic TPU kernel. q: [T, H, D] -> [T, H, D]; padding rows give zeros.

    ``interpret=True`` runs it in the TPU interpreter (pltpu.InterpretParams) on any backend.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, two_kvh, _ = kv_pages.shape
    kv_heads = two_kvh // 2
    group = num_heads // kv_heads
    num_seqs_max, pages_per_seq = page_tables.shape
    dbq, dppb = default_block_sizes(page_size, interpret)
    bq = block_q or dbq
    ppb = pages_per_block or dppb
    if bq % 8:
        raise ValueError(f"block_q must be a multiple of 8, got {bq}")

    t_pad = -(-num_tokens // bq) * bq
    nqb = t_pad // bq
    qt = jnp.swapaxes(q, 0, 1)  # [H, T, D]: per-head rows are contiguous (sublane x lane tiles)
    if t_pad != num_tokens:
        qt = jnp.pad(qt, ((0, 0), (0, t_pad - num_tokens), (0, 0)))
    cu = cu_q_lens.astype(jnp.int32)
    seq_lo, seq_hi = q_block_seq_ranges(cu, nqb, bq)

    q_spec = pl.BlockSpec((group, bq, head_dim), lambda h, i, *_: (h, i, 0))
    scratch = [
        pltpu.VMEM((2, ppb, page_size, head_dim), kv_pages.dtype),
        pltpu.VMEM((2, ppb, page_size, head_dim), kv_pages.dtype),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.VMEM((group, bq, _LANES), jnp.float32),
        pltpu.VMEM((group, bq, _LANES), jnp.float32),
        pltpu.VMEM((group, bq, head_dim), jnp.float32),
    ]
    precision = jax.lax.Precision.HIGHEST if kv_pages.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                               pages_per_seq=pages_per_seq, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(kv_heads, nqb),
            in_specs=[q_spec, pl.BlockSpec(memory_space=_ANY)],
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        # Grid steps are independent (no DMA crosses a step), so KV heads can split over cores.
        compiler_params=_CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jaxserve_ragged_paged_attention_tpu",
    )(kv_lens.astype(jnp.int32), page_tables.astype(jnp.int32).reshape(-1), cu, seq_lo, seq_hi,
      num_seqs.astype(jnp.int32).reshape(-1)[:1], qt, kv_pages)
    return jnp.swapaxes(out[:, :num_tokens], 0, 1)
