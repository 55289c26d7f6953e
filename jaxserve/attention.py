"""Ragged paged attention: the XLA reference path and the backend switch.

One flat batch of query tokens mixes decodes and prefill chunks of several sequences.
Sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]``; its KV (new tokens included,
already written) is ``kv_lens[s]`` tokens long and lives in the pages ``page_tables[s]``.

KV pool layout: ``[num_pages, page_size, 2 * kv_heads, head_dim]`` with K and V interleaved on
the head axis (K of head h at 2h, V at 2h+1), as tpu-inference does: one DMA brings both.
Page 0 is the null page; padding tokens write there and no sequence owns it. On TPU with head_dim
< 128 the same bytes are stored lane-dense instead, ``[num_pages, page_size * W, 128]``
(``KV_LAYOUT_LANES``; W = 2*KVH*D/128): XLA gives a 64-wide minor dim a transposed TPU layout,
and would copy the whole pool around the kernel on every step (``pool_layout``).

The XLA reference gathers, for every query token, a block of its own sequence's pages at a time
and folds it into an online softmax: the oracle that every kernel is tested against. CPUs serve
through the C++ kernel of ``jaxserve.cpu_kernels``, or through ``ragged_paged_attention_split``
below where that kernel cannot be built; TPUs and GPUs through ``jaxserve.pallas_kernels``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

NULL_PAGE = 0
# An fp8 (e4m3) pool on CPU is stored as its bytes: XLA's CPU backend has no fp8 arithmetic and
# converted the whole fp8 pool carried through the layer scan at every KV write (1.9 s a step
# measured at 20,000 pages). Readers view gathered pages back as fp8 (pool_values).
FP8_BITS = jnp.uint8
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


def pool_values(kv: jax.Array) -> jax.Array:
    """Pool elements as float32: a float or int8 pool upcast, an FP8_BITS one decoded as e4m3."""
    if kv.dtype == FP8_BITS:
        kv = jax.lax.bitcast_convert_type(kv, jnp.float8_e4m3fn)
    return kv.astype(jnp.float32)


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


def row_metadata(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int) -> tuple:
    """Per flat query row: (sequence, sequence clamped to a valid row, real row?, the sequence's
    query length, its KV length, the row's KV position). Row i of a sequence sits at KV position
    kv_len - q_len + i; padding rows get kv_len 0."""
    seq = token_sequence_ids(cu_q_lens, num_tokens)
    valid = seq < num_seqs[0]
    seq_c = jnp.minimum(seq, kv_lens.shape[0] - 1)
    q_start = cu_q_lens[seq_c]
    q_len = cu_q_lens[seq_c + 1] - q_start
    kv_len = jnp.where(valid, kv_lens[seq_c], 0)
    q_pos = kv_len - q_len + (jnp.arange(num_tokens, dtype=jnp.int32) - q_start)
    return seq, seq_c, valid, q_len, kv_len, q_pos


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

    seq, seq_c, valid_row, q_len, kv_len, q_pos = row_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    token_pages = page_tables[seq_c]  # [T, P]
    qf = q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim) * sm_scale
    lo = jnp.zeros_like(q_pos) if sliding_window is None else q_pos - sliding_window + 1

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(token_pages, i * pb, pb, axis=1)
        kv = pool_values(kv_pages[pages].reshape(num_tokens, block, kv_heads, 2, head_dim))
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


_ROW_BLOCK = 16  # query rows per step of the fast path's outer loop


def _merge(a: tuple, b: tuple) -> tuple:
    """Combine two partial softmax states (max, sum, weighted values) over disjoint key sets."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = jnp.maximum(m1, m2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a1, a2 = jnp.exp(m1 - m_safe), jnp.exp(m2 - m_safe)
    return m, l1 * a1 + l2 * a2, o1 * a1[..., None] + o2 * a2[..., None]


def ragged_paged_attention_split(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    k_new: jax.Array,
    v_new: jax.Array,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """The XLA serving path: same result as the reference, computed in two parts.

    - The tokens of this step attend to each other densely (same sequence, causal): a [T, T]
      product, cheap at the token budgets we serve, and no gather at all.
    - Each block of 16 query rows walks only as many pages of earlier context as its rows need
      (a per-block dynamic trip count), so fresh prefill rows read no pages and decode rows read
      exactly their context. The reference instead gathers every row's pages up to the step's
      longest sequence, which made a 512-token prefill step 5x slower on CPU.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, two_kvh, _ = kv_pages.shape
    kv_heads = two_kvh // 2
    group = num_heads // kv_heads
    max_pages = page_tables.shape[1]
    pb = max(1, min(max_pages, _KV_BLOCK_TOKENS // page_size))
    if max_pages % pb:
        page_tables = jnp.pad(page_tables, ((0, 0), (0, pb - max_pages % pb)))
    block = pb * page_size

    seq, seq_c, valid, q_len, kv_len, q_pos = row_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    prefix = jnp.where(valid, kv_len - q_len, 0)  # context already in pages before this step
    lo = jnp.zeros_like(q_pos) if sliding_window is None else q_pos - sliding_window + 1
    qf = q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim) * sm_scale

    def capped(s):
        return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)

    # Part 1: this step's own tokens, computed head-major ([KVH, T*G, ...]): XLA's CPU dots want
    # the batch axis leading, and this layout ran the [T, T] products 2-3x faster than token-major.
    q_heads = qf.transpose(1, 0, 2, 3).reshape(kv_heads, num_tokens * group, head_dim)
    s = capped(jnp.einsum("kmd,kud->kmu", q_heads, pool_values(k_new).transpose(1, 0, 2)))
    rows = jnp.arange(num_tokens)
    mask = (seq[:, None] == seq[None, :]) & valid[:, None] & (rows[None, :] <= rows[:, None])
    if sliding_window is not None:
        mask &= q_pos[None, :] >= lo[:, None]
    s = jnp.where(jnp.repeat(mask, group, axis=0)[None], s, -jnp.inf)  # row m of a head = token m // G
    m1 = s.max(-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m1), m1, 0.0)[..., None])
    pv = jnp.einsum("kmu,kud->kmd", p, pool_values(v_new).transpose(1, 0, 2))

    def token_major(x):  # [KVH, T*G, ...] -> [T, KVH, G, ...]
        x = x.reshape(kv_heads, num_tokens, group, *x.shape[2:])
        return x.transpose(1, 0, 2, *range(3, x.ndim))

    part_new = (token_major(m1), token_major(p.sum(-1)), token_major(pv))

    # Part 2: earlier context from the pages, row block by row block.
    pad = (-num_tokens) % _ROW_BLOCK
    def blocks(x):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, _ROW_BLOCK, *x.shape[1:])

    def row_block(_, xs):
        qb, pages_b, prefix_b, lo_b = xs

        def body(i, carry):
            pages = jax.lax.dynamic_slice_in_dim(pages_b, i * pb, pb, axis=1)
            kv = pool_values(kv_pages[pages].reshape(_ROW_BLOCK, block, kv_heads, 2, head_dim))
            sc = capped(jnp.einsum("tkgd,tskd->tkgs", qb, kv[..., 0, :]))
            j = i * block + jnp.arange(block, dtype=jnp.int32)
            ok = (j[None, :] < prefix_b[:, None]) & (j[None, :] >= lo_b[:, None])
            sc = jnp.where(ok[:, None, None, :], sc, -jnp.inf)
            m = sc.max(-1)
            pr = jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
            return _merge(carry, (m, pr.sum(-1), jnp.einsum("tkgs,tskd->tkgd", pr, kv[..., 1, :])))

        shape = (_ROW_BLOCK, kv_heads, group)
        init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
        first = jnp.maximum(jnp.min(jnp.where(prefix_b > 0, lo_b, 2**30)), 0) // block
        last = (jnp.max(prefix_b) + block - 1) // block
        return None, jax.lax.fori_loop(jnp.minimum(first, last), last, body, init)

    xs = (blocks(qf), blocks(page_tables[seq_c]), blocks(prefix), blocks(lo))
    _, part_old = jax.lax.scan(row_block, None, xs)
    part_old = tuple(x.reshape(-1, *x.shape[2:])[:num_tokens] for x in part_old)
    _, l, acc = _merge(part_new, part_old)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


BACKENDS = ("auto", "xla", "pallas", "cpu", "xla-reference")
KV_LAYOUT_PAGES, KV_LAYOUT_LANES = "pages", "lanes"
_LANES = 128


def pool_layout(backend: str, head_dim: int, num_kv_heads: int, model_parallel: int = 1,
                platform: str | None = None) -> str:
    """How the pool is stored: lane-dense on TPU for head_dim < 128 (the kernel's page view is then
    the array itself, with no relayout copy), the 4-D page layout everywhere else. Tensor-parallel
    meshes keep the 4-D layout: they split the pool over its head axis, which the lane-dense rows
    interleave with the token axis."""
    lanes_fit = head_dim < _LANES and (2 * num_kv_heads * head_dim) % _LANES == 0
    platform = jax.default_backend() if platform is None else platform
    on_tpu = platform == "tpu" and backend in ("auto", "pallas")  # what resolve_backend gives there
    return KV_LAYOUT_LANES if lanes_fit and on_tpu and model_parallel == 1 else KV_LAYOUT_PAGES


def pool_shape(layout: str, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
               head_dim: int) -> tuple[int, ...]:
    """The pool array's shape for a layout (the same number of elements either way)."""
    if layout == KV_LAYOUT_LANES:
        return (num_layers, num_pages, page_size * 2 * num_kv_heads * head_dim // _LANES, _LANES)
    return (num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)


def with_pool_layout(attention_fn: Any, kv_write_fn: Any, layout: str, page_size: int) -> tuple[Any, Any]:
    """Attention and KV-write functions for a pool stored in `layout` (the model passes the pool
    through as it is)."""
    if layout == KV_LAYOUT_PAGES:
        return attention_fn, kv_write_fn
    from jaxserve.pallas_kernels.ragged_paged_attention_tpu import write_kv_rows

    return (functools.partial(attention_fn, pool_page_size=page_size),
            functools.partial(write_kv_rows, page_size=page_size))


def resolve_backend(backend: str) -> str:
    """'auto' -> 'pallas' on TPU/GPU; on CPU the C++ kernel ('cpu'), or 'xla' where it cannot be built."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        if jax.default_backend() != "cpu":
            return "pallas"
        from jaxserve import cpu_kernels

        return "cpu" if cpu_kernels.available() else "xla"
    return backend


@functools.lru_cache(maxsize=None)
def get_attention_fn(backend: str) -> Any:
    """The attention function of a backend. All take the reference's arguments plus the step's
    new keys and values (k_new, v_new: [T, KVH, D], already written to the pages); only the XLA
    serving path uses them."""
    backend = resolve_backend(backend)
    if backend == "xla":
        return ragged_paged_attention_split
    if backend == "xla-reference":
        kernel = ragged_paged_attention_xla
    elif backend == "cpu":
        from jaxserve.cpu_kernels import ragged_paged_attention_cpu as kernel
    else:
        from jaxserve.pallas_kernels import ragged_paged_attention_pallas as kernel

    def from_pages(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs, *, k_new=None, v_new=None, **kw):
        return kernel(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs, **kw)

    return from_pages
