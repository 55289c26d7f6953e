"""The KV cache's storage dtype, and 8-bit KV (int8, fp8 e4m3) with static scales.

An 8-bit pool holds K / k_scale and V / v_scale, rounded into int8 or float8_e4m3fn, with static
scales per layer, KV head and channel (tpu-inference and vLLM keep one k_scale/v_scale per layer;
per channel costs nothing more here, and int8 needs it: K has outlier channels, and a scale shared
with them leaves the other channels a few levels). Every attention backend reads such a pool as if
it held floats (it upcasts what it loads); the scales never enter a kernel, channel by channel:
    q . (k_q * ks) = (q * ks) . k_q                -> q is multiplied by its KV head's K scales,
    sum_j p_j (v_q_j * vs) = vs * sum_j p_j v_q_j  -> the output by the V scales.

The scales come from a calibration pass at start-up: the model prefills a fixed text into a
float pool, and the largest |K| and |V| of each layer, head and channel there, times
`CALIBRATION_MARGIN`, map to the format's largest value. Larger values at serving time saturate.

The layer of a call is read off its indices, because the model views the pool flat over layers
(layer l's pages are l * num_pages + page; see LlamaForCausalLM.__call__): the backends and the
model keep their signatures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import FP8_BITS

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8")
_STORAGE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
            "int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8": jnp.float8_e4m3fn}
# The largest value each 8-bit format stores (int8 symmetric: -127..127, so that -x is stored too;
# FP8_BITS is e4m3 kept as its bytes, see attention.FP8_BITS).
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(FP8_BITS): 448.0}
# Headroom over the calibration text's largest |K| / |V|: prompts unlike it may reach further.
CALIBRATION_MARGIN = 2.0


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return name


def storage_dtype(name: str, model_dtype: Any, platform: str) -> np.dtype:
    """The pool's dtype: the model's for "auto", else the one named; fp8 on CPU as its bytes."""
    check_kv_cache_dtype(name)
    dtype = jnp.dtype(model_dtype if name == "auto" else _STORAGE[name])
    return jnp.dtype(FP8_BITS) if dtype == jnp.dtype(jnp.float8_e4m3fn) and platform == "cpu" else dtype


def is_8bit(dtype: Any) -> bool:
    return jnp.dtype(dtype) in QMAX


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVScales:
    """k, v: [layers, kv_heads, head_dim] float32; the pool stores K / k and V / v."""

    k: jax.Array
    v: jax.Array


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """x [T, KVH, D] / scale [KVH, D], rounded (int8) and saturated into `dtype`."""
    qmax = QMAX[jnp.dtype(dtype)]
    y = jnp.clip(x.astype(jnp.float32) / scale[None], -qmax, qmax)
    if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
        y = jnp.round(y)
    if jnp.dtype(dtype) == jnp.dtype(FP8_BITS):
        return jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), FP8_BITS)
    return y.astype(dtype)


def with_kv_scales(attention_fn: Callable[..., jax.Array], kv_write_fn: Callable[..., jax.Array],
                   scales: KVScales, num_pages: int, page_size: int) -> tuple[Callable, Callable]:
    """Attention and KV-write functions over an 8-bit pool, from those over a float one."""

    def write(pool: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
        layer = slot_mapping[0] // (num_pages * page_size)  # every slot of a call is in its layer
        return kv_write_fn(pool, quantize(k, scales.k[layer], pool.dtype), quantize(v, scales.v[layer], pool.dtype),
                           slot_mapping)

    def attend(q: jax.Array, pool: jax.Array, kv_lens: jax.Array, page_tables: jax.Array, cu_q_lens: jax.Array,
               num_seqs: jax.Array, *, k_new: jax.Array | None = None, v_new: jax.Array | None = None,
               **kw: Any) -> jax.Array:
        layer = page_tables[0, 0] // num_pages  # NULL_PAGE entries too are offset into the layer
        ks, vs = scales.k[layer], scales.v[layer]
        group = q.shape[1] // ks.shape[0]
        per_head = lambda s: jnp.repeat(s, group, axis=0)[None]  # noqa: E731  [KVH, D] -> [1, H, D]
        if k_new is not None:  # the XLA path reads this step's K/V directly: give it what the pool holds
            k_new, v_new = quantize(k_new, ks, pool.dtype), quantize(v_new, vs, pool.dtype)
        out = attention_fn((q.astype(jnp.float32) * per_head(ks)).astype(q.dtype), pool, kv_lens, page_tables,
                           cu_q_lens, num_seqs, k_new=k_new, v_new=v_new, **kw)
        return (out.astype(jnp.float32) * per_head(vs)).astype(out.dtype)

    return attend, write


# Calibration text: prose, code, numbers and a list, so that the usual kinds of token reach the
# model; written for this purpose.
CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came in before dawn, and by seven the market on the
quay was loud with prices: mackerel at 4.20 a kilo, crab at 11, the first lemons of the season at
2.75 a bag. Maria counted the crates twice, wrote the totals in her notebook, and sent her brother
to the bank with the envelope.

def moving_average(values: list[float], window: int = 3) -> list[float]:
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    for i in range(len(values) - window + 1):
        out.append(sum(values[i:i + window]) / window)
    return out

Q: What is 17 multiplied by 23? A: 391. Q: Name three primary colours. A: red, yellow and blue.
1. Preheat the oven to 180 C. 2. Mix flour, sugar and eggs. 3. Bake for 35 minutes.
{"id": 1042, "name": "sensor-7", "readings": [0.12, 0.15, -0.03], "ok": true}
Dear team, the meeting moves to Thursday at 14:30; please bring the quarterly figures.
"""


def calibrate(model: Any, token_ids: list[int], page_size: int, dtype: Any) -> KVScales:
    """Per-layer, per-head, per-channel K and V scales for an 8-bit pool of `dtype`: the model prefills
    `token_ids` as one sequence into a small float pool (XLA attention), and the largest |K|, |V|
    written there, times CALIBRATION_MARGIN, map to the format's largest value."""
    from flax import nnx

    from jaxserve.attention import AttentionMetadata, get_attention_fn, write_kv

    cfg = model.cfg
    graphdef, state = nnx.split(model)  # the weights as arguments, not as constants of the program
    n = len(token_ids)
    pages = -(-n // page_size) + 1  # page 0 is the null page
    pos = np.arange(n, dtype=np.int32)
    md = AttentionMetadata(positions=jnp.asarray(pos), slot_mapping=jnp.asarray(page_size + pos),
                           kv_lens=jnp.asarray([n], jnp.int32),
                           page_tables=jnp.arange(1, pages, dtype=jnp.int32)[None],
                           cu_q_lens=jnp.asarray([0, n], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32))

    @jax.jit
    def amax(state: Any, tokens: jax.Array, md: AttentionMetadata) -> jax.Array:
        pool = jnp.zeros((cfg.num_layers, pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim), model.dtype)
        _, pool = nnx.merge(graphdef, state)(tokens, md, pool, get_attention_fn("xla"), write_kv)
        kv = jnp.abs(pool.astype(jnp.float32)).reshape(cfg.num_layers, -1, cfg.num_kv_heads, 2, cfg.head_dim)
        return kv.max(axis=1)  # [L, KVH, 2, D]

    top = np.asarray(amax(state, jnp.asarray(token_ids, jnp.int32), md))
    scale = np.maximum(top * CALIBRATION_MARGIN / QMAX[jnp.dtype(dtype)], 1e-6).astype(np.float32)
    return KVScales(k=jnp.asarray(scale[:, :, 0]), v=jnp.asarray(scale[:, :, 1]))
