"""Pallas ragged paged attention, dispatched by platform; same contract as the XLA reference."""

from __future__ import annotations

import jax

from jaxserve.pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from jaxserve.pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu


def ragged_paged_attention_pallas(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs, **kw) -> jax.Array:
    """TPU: jax's Mosaic kernel. GPU: our split-K kernel compiled by Triton. CPU: the same GPU
    kernel in interpret mode (the TPU kernel's interpreter fails under jax 0.10.2)."""
    platform = jax.default_backend()
    if platform == "tpu":
        return ragged_paged_attention_tpu(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs, **kw)
    return ragged_paged_attention_gpu(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs,
                                      interpret=platform == "cpu", **kw)


__all__ = ["ragged_paged_attention_pallas", "ragged_paged_attention_gpu", "ragged_paged_attention_tpu"]
