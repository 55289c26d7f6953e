"""Pallas ragged paged attention, dispatched by platform; same contract as the XLA reference.

tpu -> our Mosaic TPU kernel; gpu -> our Triton kernels (split-K decode + query-block prefill);
cpu -> the GPU kernels with ``interpret=True``. On CPU the Triton-style kernels are interpreted by
discharging them into ordinary XLA ops (a loop over the grid), which jit-compiles and runs inside
the model's lax.scan at reasonable speed (measured here: ~8 ms for a 12-decode + 40-token-prefill
step, 2 KV heads x group 4, d=128, vs ~47 ms for the XLA reference). The TPU interpreter instead
simulates every DMA and semaphore through host callbacks (~3.7 s for the same step), so it is
only used by the tests (``ragged_paged_attention_tpu(..., interpret=True)``).
"""

from __future__ import annotations

import jax

from jaxserve.attention import FP8_BITS
from jaxserve.pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from jaxserve.pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu


def ragged_paged_attention_pallas(
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
    block_q: int | None = None,
    block_kv: int | None = None,
    split_tokens: int | None = None,
    pool_page_size: int | None = None,
) -> jax.Array:
    """Ragged paged attention through Pallas. q: [T, H, D] -> [T, H, D]; padding rows give zeros.

    kv_pages: [N, page, 2*KVH, D], or lane-dense [N, page * 2*KVH*D/128, 128] with
    `pool_page_size` (what the TPU kernel reads without a relayout; other platforms view it back
    as pages, a free reshape there).

    Block sizes are optional: TPU uses block_q (query tokens per grid step) and pages_per_block;
    GPU/CPU use block_q (prefill query rows = tokens x heads of one GQA group, per program),
    block_kv (KV token slots per step; defaults to pages_per_block * page_size if only that is
    given) and split_tokens (decode split length; by default chosen to fill the GPU).
    """
    if kv_pages.dtype == FP8_BITS:
        raise ValueError("an fp8 KV pool stored as bytes (CPU) is read by the 'cpu' and 'xla' attention backends, "
                         "not by the Pallas kernels")
    args = (q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    platform = jax.default_backend()
    if platform == "tpu":
        return ragged_paged_attention_tpu(*args, **kw, block_q=block_q, pages_per_block=pages_per_block,
                                          pool_page_size=pool_page_size)
    if pool_page_size is not None:
        head_dim = q.shape[2]
        n, rows, lanes = kv_pages.shape
        args = (q, kv_pages.reshape(n, pool_page_size, rows * lanes // (pool_page_size * head_dim), head_dim),
                *args[2:])
    gpu_kw = {}
    if block_q is not None:
        gpu_kw["block_q"] = block_q
    if block_kv is not None:
        gpu_kw["block_kv"] = block_kv
    elif pages_per_block is not None:  # the GPU kernel rounds it to a power of two and names it in errors
        gpu_kw["pages_per_block"] = pages_per_block
    if split_tokens is not None:
        gpu_kw["split_tokens"] = split_tokens
    if platform == "cpu":
        # Interpreted, a block costs its full size whatever the lengths; 64 x 64 measured best.
        gpu_kw.setdefault("block_q", 64)
        gpu_kw.setdefault("block_kv", 64)
        gpu_kw.setdefault("split_tokens", 1 << 30)  # one split: no parallelism to gain on CPU
    return ragged_paged_attention_gpu(*args, **kw, **gpu_kw, interpret=platform != "gpu")


__all__ = ["ragged_paged_attention_pallas", "ragged_paged_attention_gpu", "ragged_paged_attention_tpu"]
