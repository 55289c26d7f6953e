"""Ragged paged attention: the XLA reference path and the backend switch.

One flat batch of query tokens mixes decodes and prefill chunks of several sequences.
Sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]``; its KV (new tokens included,
already written) is ``kv_lens[s]`` tokens long and lives in the pages ``page_tables[s]``.

KV pool layout: ``[num_pages, page_size, 2 * kv_heads, head_dim]`` with K and V interleaved on
the head axis (K of head h at 2h, V at 2h+1), as tpu-inference does: one DMA brings both.
Page 0 is the null page; padding tokens write there and no sequence owns it.

The XLA reference gathers, for every query token, the pages of its own sequence. That costs
``T x max_kv`` gathered KV, chunked over tokens to bound memory; on CPU it is the serving path
and everywhere it is the oracle that the Pallas kernels are tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

NULL_PAGE = 0
_TOKEN_CHUNK = 64  # query tokens per gather chunk of the reference: bounds peak memory


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
) -> jax.Array:
    """Reference ragged paged attention. q: [T, H, D] -> [T, H, D]; padding rows give zeros."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, two_kvh, _ = kv_pages.shape
    kv_heads = two_kvh // 2
    group = num_heads // kv_heads
    max_pages = page_tables.shape[1]
    max_kv = max_pages * page_size

    seq = token_sequence_ids(cu_q_lens, num_tokens)
    valid_row = seq < num_seqs[0]
    seq_c = jnp.minimum(seq, page_tables.shape[0] - 1)
    q_start = cu_q_lens[seq_c]
    q_len = cu_q_lens[seq_c + 1] - q_start
    kv_len = jnp.where(valid_row, kv_lens[seq_c], 0)
    # Query row i of a sequence sits at KV position kv_len - q_len + i.
    q_pos = kv_len - q_len + (jnp.arange(num_tokens, dtype=jnp.int32) - q_start)

    pad = (-num_tokens) % _TOKEN_CHUNK if num_tokens > _TOKEN_CHUNK else 0
    chunk = min(_TOKEN_CHUNK, num_tokens)

    def padded(x):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))

    qf = padded(q.astype(jnp.float32)).reshape(-1, chunk, kv_heads, group, head_dim)
    pt = padded(page_tables[seq_c]).reshape(-1, chunk, max_pages)
    kvl = padded(kv_len).reshape(-1, chunk)
    qp = padded(q_pos).reshape(-1, chunk)

    kv_idx = jnp.arange(max_kv, dtype=jnp.int32)

    def one_chunk(args):
        qc, ptc, kvlc, qpc = args
        kv = kv_pages[ptc].reshape(chunk, max_kv, kv_heads, 2, head_dim).astype(jnp.float32)
        k, v = kv[..., 0, :], kv[..., 1, :]
        s = jnp.einsum("tkgd,tskd->tkgs", qc, k) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = (kv_idx[None, :] < kvlc[:, None]) & (kv_idx[None, :] <= qpc[:, None])
        if sliding_window is not None:
            mask &= kv_idx[None, :] > qpc[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("tkgs,tskd->tkgd", p, v) / jnp.where(denom > 0, denom, 1.0)
        return o

    out = jax.lax.map(one_chunk, (qf, pt, kvl, qp))
    out = out.reshape(-1, num_heads, head_dim)[:num_tokens]
    return jnp.where(valid_row[:, None, None], out, 0.0).astype(q.dtype)


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
