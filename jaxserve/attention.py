"""Ragged paged attention: the XLA reference path and the backend switch.

One flat batch of query tokens mixes decodes and prefill chunks of several sequences.
Sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]``; its KV (new tokens included,
already written) is ``kv_lens[s]`` tokens long and lives in the pages ``page_tables[s]``.

KV pool layout: ``[num_pages, page_size, 2 * kv_heads, head_dim]`` with K and V interleaved on
the head axis (K of head h at 2h, V at 2h+1), as tpu-inference does: one DMA brings both.
Page 0 is the null page; padding tokens write there and no sequence owns it.

The XLA reference gathers, for every query token, a block of its own sequence's pages at a time
and folds it into an online softmax. On CPU it is the serving path, and everywhere it is the
oracle that the Pallas kernels are tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

NULL_PAGE = 0
_KV_BLOCK_TOKENS = 64  # KV slots per step of the reference's page loop (measured best on CPU)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, all device arrays of fixed (bucketed) shape.

    positions:    [T] int32   position of each query token in its sequence
    slot_mapping: [T] int32   flat KV slot (page * page_size + offset) each new token writes to
    kv_lens:      [S] int32   KV length per sequence, new tokens included (0 for padding rows)
    page_tables:  [S, P] int32 pages of each sequence, NULL_PAGE past its end
    cu_q_lens:    [S + 1] int32 cumulative query lengths
    num_seqs:     [1] int32   number of real sequences (rows past it are padding)
    """

    positions: jax.Array
    slot_mapping: jax.Array
    kv_lens: jax.Array
    page_tables: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new K/V [T, KVH, D] into their slots of the pool [N, page_size, 2*KVH, D]."""
    num_pages, page_size, two_kvh, head_dim = kv_pages.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], two_kvh, head_dim).astype(kv_pages.dtype)
    flat = kv_pages.reshape(num_pages * page_size, two_kvh, head_dim)
    flat = flat.at[slot_mapping].set(kv, mode="drop", unique_indices=False)
    return flat.reshape(kv_pages.shape)


def token_sequence_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Sequence index of each flat query row (rows past the last sequence map past the end)."""
    return jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right")


def ragged_paged_attention_xla(
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
    pages_per_block: int | None = None,
) -> jax.Array:
    """Reference ragged paged attention. q: [T, H, D] -> [T, H, D]; padding rows give zeros.

    Walks the KV in blocks of pages with an online softmax, only as far as the longest sequence
    of this step reaches (a dynamic trip count), so no step pays for its page-table bucket and
    nothing of size T x max_kv is ever materialised.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, two_kvh, _ = kv_pages.shape
    kv_heads = two_kvh // 2
    group = num_heads // kv_heads
    max_pages = page_tables.shape[1]
    pb = pages_per_block or max(1, min(max_pages, _KV_BLOCK_TOKENS // page_size))
    if max_pages % pb:
        page_tables = jnp.pad(page_tables, ((0, 0), (0, pb - max_pages % pb)))
    block = pb * page_size

    seq = token_sequence_ids(cu_q_lens, num_tokens)
    valid_row = seq < num_seqs[0]
    seq_c = jnp.minimum(seq, page_tables.shape[0] - 1)
    q_start = cu_q_lens[seq_c]
    q_len = cu_q_lens[seq_c + 1] - q_start
    kv_len = jnp.where(valid_row, kv_lens[seq_c], 0)
    # Query row i of a sequence sits at KV position kv_len - q_len + i.
    q_pos = kv_len - q_len + (jnp.arange(num_tokens, dtype=jnp.int32) - q_start)
    token_pages = page_tables[seq_c]  # [T, P]
    qf = q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim) * sm_scale
    lo = jnp.zeros_like(q_pos) if sliding_window is None else q_pos - sliding_window + 1

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(token_pages, i * pb, pb, axis=1)
        kv = kv_pages[pages].reshape(num_tokens, block, kv_heads, 2, head_dim).astype(jnp.float32)
        s = jnp.einsum("tkgd,tskd->tkgs", qf, kv[..., 0, :])
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        j = i * block + jnp.arange(block, dtype=jnp.int32)
        mask = (j[None, :] < kv_len[:, None]) & (j[None, :] <= q_pos[:, None]) & (j[None, :] >= lo[:, None])
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        acc = acc * alpha[..., None] + jnp.einsum("tkgs,tskd->tkgd", p, kv[..., 1, :])
        return m_new, l * alpha + p.sum(-1), acc

    first = 0 if sliding_window is None else jnp.maximum(jnp.min(jnp.where(valid_row, lo, 2**30)), 0) // block
    last = (jnp.max(kv_len) + block - 1) // block
    init = (jnp.full((num_tokens, kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, last, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid_row[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def resolve_backend(backend: str) -> str:
    """'auto' -> 'pallas' on TPU/GPU, 'xla' on CPU."""
    if backend not in ("auto", "xla", "pallas"):
        raise ValueError(f"attention_backend must be 'auto', 'xla' or 'pallas', got {backend!r}")
    if backend == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    return backend


@functools.lru_cache(maxsize=None)
def get_attention_fn(backend: str) -> Any:
    """The ragged paged attention function of a resolved backend (same signature as the reference)."""
    backend = resolve_backend(backend)
    if backend == "xla":
        return ragged_paged_attention_xla
    from jaxserve.pallas_kernels import ragged_paged_attention_pallas

    return ragged_paged_attention_pallas
