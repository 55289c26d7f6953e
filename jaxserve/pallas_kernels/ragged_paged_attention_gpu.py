"""Ragged paged attention as a Pallas kernel in the GPU (Triton) style, with split-K.

One program per (query row, KV head, KV split): it loads the row's pages a block at a time by
vector-indexing the page table, runs an online softmax over its share of the context, and writes
an unnormalised partial result; the splits are then combined (flash-decoding). All query heads of
a KV head (the GQA group) share each page load. Prefill rows run as independent rows too: correct
for any mix, though a prefill row re-reads pages that its neighbours also read.

On CPU it runs with interpret=True, which is how the tests check it against the XLA reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.attention import token_sequence_ids

try:  # moved between jax releases
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(kv_len_ref, q_pos_ref, lo_ref, pages_ref, q_ref, k_ref, v_ref, o_ref, l_ref, m_ref, *,
            sm_scale: float, soft_cap: float | None, page_size: int, pages_per_block: int,
            pages_per_split: int):
    split = pl.program_id(2)
    q = q_ref[...].astype(jnp.float32) * sm_scale  # [G, D]
    kv_len, q_pos, lo = kv_len_ref[0], q_pos_ref[0], lo_ref[0]
    limit = jnp.minimum(kv_len, q_pos + 1)  # causal: keys up to the row's own position
    block = pages_per_block * page_size
    start = split * pages_per_split * page_size
    n_blocks = jnp.clip((limit - start + block - 1) // block, 0, pages_per_split // pages_per_block)

    def body(i, carry):
        acc, l, m = carry
        first_page = split * pages_per_split + i * pages_per_block
        table = pages_ref[pl.ds(first_page, pages_per_block)]
        k = k_ref[table].reshape(block, -1).astype(jnp.float32)
        v = v_ref[table].reshape(block, -1).astype(jnp.float32)
        s = jnp.dot(q, k.T)  # [G, block]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        j = start + i * block + jnp.arange(block)
        ok = (j < limit) & (j >= lo)
        s = jnp.where(ok[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        return acc * alpha[:, None] + jnp.dot(p, v), l * alpha + p.sum(axis=-1), m_new

    g, d = q.shape
    init = (jnp.zeros((g, d), jnp.float32), jnp.zeros((g,), jnp.float32), jnp.full((g,), -jnp.inf, jnp.float32))
    acc, l, m = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = acc
    l_ref[...] = l
    m_ref[...] = m


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "pages_per_block",
                                             "num_splits", "interpret"))
def ragged_paged_attention_gpu(
    q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_tables: jax.Array, cu_q_lens: jax.Array,
    num_seqs: jax.Array, *, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    pages_per_block: int = 4, num_splits: int = 4, interpret: bool = False,
) -> jax.Array:
    """Same contract as `jaxserve.attention.ragged_paged_attention_xla`."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, two_kvh, _ = kv_pages.shape
    kv_heads = two_kvh // 2
    group = num_heads // kv_heads
    g_pad = max(16, _next_pow2(group))  # Triton's dot wants >= 16 rows
    pages_per_block = min(pages_per_block, _next_pow2(page_tables.shape[1]))
    # Pad the page-table width so that it splits into whole blocks per split.
    unit = pages_per_block * num_splits
    width = -(-page_tables.shape[1] // unit) * unit
    page_tables = jnp.pad(page_tables, ((0, 0), (0, width - page_tables.shape[1])))

    seq = token_sequence_ids(cu_q_lens, num_tokens)
    valid = seq < num_seqs[0]
    seq_c = jnp.minimum(seq, page_tables.shape[0] - 1)
    q_start = cu_q_lens[seq_c]
    kv_len = jnp.where(valid, kv_lens[seq_c], 0).astype(jnp.int32)
    q_pos = (kv_len - (cu_q_lens[seq_c + 1] - q_start) + jnp.arange(num_tokens) - q_start).astype(jnp.int32)
    lo = jnp.zeros_like(q_pos) if sliding_window is None else q_pos - sliding_window + 1
    row_pages = page_tables[seq_c]  # [T, width]
    qg = q.reshape(num_tokens, kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g_pad - group), (0, 0)))

    kernel = functools.partial(_kernel, sm_scale=sm_scale, soft_cap=soft_cap, page_size=page_size,
                               pages_per_block=pages_per_block, pages_per_split=width // num_splits)
    n_pages = kv_pages.shape[0]
    row = lambda t, h, s: (t,)  # noqa: E731
    kw = {}
    if not interpret and plgpu is not None:
        kw["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=2)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(num_tokens, kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((1,), row), pl.BlockSpec((1,), row), pl.BlockSpec((1,), row),
            pl.BlockSpec((None, width), lambda t, h, s: (t, 0)),
            pl.BlockSpec((None, None, g_pad, head_dim), lambda t, h, s: (t, h, 0, 0)),
            # The pool is passed twice: K of head h is combined head 2h, V is 2h + 1.
            pl.BlockSpec((n_pages, page_size, None, head_dim), lambda t, h, s: (0, 0, 2 * h, 0)),
            pl.BlockSpec((n_pages, page_size, None, head_dim), lambda t, h, s: (0, 0, 2 * h + 1, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, g_pad, head_dim), lambda t, h, s: (s, t, h, 0, 0)),
            pl.BlockSpec((None, None, None, g_pad), lambda t, h, s: (s, t, h, 0)),
            pl.BlockSpec((None, None, None, g_pad), lambda t, h, s: (s, t, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, num_tokens, kv_heads, g_pad, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_tokens, kv_heads, g_pad), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_tokens, kv_heads, g_pad), jnp.float32),
        ],
        interpret=interpret,
        name="ragged_paged_attention_gpu",
        **kw,
    )(kv_len, q_pos, lo, row_pages, qg, kv_pages, kv_pages)
    # Combine the splits (flash-decoding's second pass).
    m_all = m.max(axis=0)
    m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.exp(m - m_safe[None])
    l_all = (l * w).sum(axis=0)
    out = (o * w[..., None]).sum(axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)[:, :, :group]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
