"""TPU: jax's own Mosaic ragged paged attention kernel (the one tpu-inference grew from).

It takes exactly our contract and pool layout (K/V interleaved on the head axis, page tables and
lengths as scalar prefetch, pages DMA'd into VMEM with double buffering, online softmax). We use
it rather than write a second one; its block sizes stay parameters here. Note: under jax 0.10.2
its interpret mode fails on CPU (a ReshapeTransform in the interpreter), so CPU tests check our
GPU-style kernel instead, and this path can only be verified on a TPU (scripts/device_check.py).
"""

from __future__ import annotations

import jax


def ragged_paged_attention_tpu(
    q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_tables: jax.Array, cu_q_lens: jax.Array,
    num_seqs: jax.Array, *, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    num_kv_pages_per_block: int | None = None, num_queries_per_block: int | None = None,
) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    return ragged_paged_attention(
        q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block)
