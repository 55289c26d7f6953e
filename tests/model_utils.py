"""Test helpers: run our model over whole prompts through a fresh paged KV pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import AttentionMetadata, get_attention_fn, write_kv
from jaxserve.kv_quant import is_8bit, with_kv_scales


def prefill_logits(model, prompts: list[list[int]], page_size: int = 16, attention_fn=None, kv_dtype=None,
                   kv_scales=None) -> list[np.ndarray]:
    """Logits [len, V] of every position of each prompt, all prompts in one ragged batch; with
    `kv_dtype` 8-bit, through a pool of that dtype and `kv_scales` (jaxserve.kv_quant)."""
    cfg = model.cfg
    attention_fn = attention_fn or get_attention_fn("xla")
    kv_write_fn = write_kv
    pages_per = [-(-len(p) // page_size) for p in prompts]
    num_pages = 1 + sum(pages_per)
    max_pages = max(pages_per)
    tables = np.zeros((len(prompts), max_pages), np.int32)
    tokens, positions, slots, cu = [], [], [], [0]
    next_page = 1  # page 0 is the null page
    for i, p in enumerate(prompts):
        tables[i, : pages_per[i]] = np.arange(next_page, next_page + pages_per[i])
        next_page += pages_per[i]
        for pos, t in enumerate(p):
            tokens.append(t)
            positions.append(pos)
            slots.append(tables[i, pos // page_size] * page_size + pos % page_size)
        cu.append(cu[-1] + len(p))
    md = AttentionMetadata(
        positions=jnp.asarray(positions, jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
        kv_lens=jnp.asarray([len(p) for p in prompts], jnp.int32), page_tables=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(cu, jnp.int32), num_seqs=jnp.asarray([len(prompts)], jnp.int32),
    )
    if kv_dtype is not None and is_8bit(kv_dtype):
        attention_fn, kv_write_fn = with_kv_scales(attention_fn, write_kv, kv_scales, num_pages, page_size)
    kv = jnp.zeros((cfg.num_layers, num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim), kv_dtype or model.dtype)
    hidden, _ = model(jnp.asarray(tokens, jnp.int32), md, kv, attention_fn, kv_write_fn)
    logits = np.asarray(model.compute_logits(hidden))
    return [logits[cu[i]: cu[i + 1]] for i in range(len(prompts))]


def teacher_forced_gap(prompts: list[list[int]], ref: list[np.ndarray], other: list[np.ndarray]) -> dict:
    """Over each prompt's positions, `other`'s logits against `ref`'s: argmax agreement and
    |log p(next token)| differences."""
    agree, dlogp = [], []
    for p, a, b in zip(prompts, ref, other):
        agree.append(a[:-1].argmax(-1) == b[:-1].argmax(-1))
        la, lb = np.asarray(jax.nn.log_softmax(a, -1)), np.asarray(jax.nn.log_softmax(b, -1))
        t = np.asarray(p[1:])[:, None]
        dlogp.append(np.abs(np.take_along_axis(la[:-1], t, 1) - np.take_along_axis(lb[:-1], t, 1))[:, 0])
    agree, dlogp = np.concatenate(agree), np.concatenate(dlogp)
    return dict(tokens=len(agree), agree=float(agree.mean()), dlogp_mean=float(dlogp.mean()),
                dlogp_max=float(dlogp.max()))
