"""Weight-only int8 quantization (``--quantization int8``).

Scheme: symmetric int8 with one float32 scale per group of 32 consecutive *input* elements of an
output (GGUF Q8_0's blocks): ``w[k, o] ~ q[o, k] * s[o, k // 32]``, ``s = max|w| / 127``. One scale
per output channel was tried first and flipped 34% of greedy tokens on the default model (its
weights come from Q4_1, whose blocks are 32 inputs wide: per-channel scales smear one block's
outliers over all of them); group scales follow those blocks.

Layout: a model weight ``[..., in, out]`` is stored transposed, ``q [..., out, in]`` int8 and
``s [..., out, in/32]`` float32, so that each output's weights and its scales are contiguous (the
CPU kernel streams them in order). A tied embedding ``[V, E]`` is already ``[out, in]`` for the LM
head: one quantized array serves the head (a linear) and the embedding (gather + dequantize rows).

``linear(x, q, s)`` is what the model calls: on one CPU device the ``jax.ffi`` kernel
(``cpu_kernels/int8_matmul.cc``); elsewhere (TPU, GPU, meshes) XLA with the weights int8 in memory
and the dequantization (convert * scale) inside the jitted dot, where XLA fuses it.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

GROUP = 32
METHODS = ("none", "int8")
# Model weights [.., in, out] quantized as linear layers. The MoE expert stacks are not (refused).
LINEAR_PARAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")
SCALE_SUFFIX = "_scale"
IMPLS = ("auto", "kernel", "xla")
QUANT_CACHE_TAG = "int8-g32-v1"  # in the converted-weights cache key: bump when the scheme changes


def check_method(method: str | None) -> str:
    method = "none" if method is None else str(method)
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {method!r}")
    return method


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., in, out] float -> (q [..., out, in] int8, s [..., out, in/32] float32)."""
    w = np.asarray(w, np.float32)
    n_in = w.shape[-2]
    if n_in % GROUP:
        raise ValueError(f"int8 quantization needs the input dimension to be a multiple of {GROUP}; "
                         f"a weight of shape {w.shape} has {n_in}")
    wt = np.swapaxes(w, -1, -2)  # [..., out, in]
    groups = wt.reshape(*wt.shape[:-1], n_in // GROUP, GROUP)
    scale = np.abs(groups).max(axis=-1) / 127.0
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)  # all-zero groups stay zero
    q = np.clip(np.rint(groups * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(wt.shape), scale.astype(np.float32)


def dequantize(q: Any, s: Any) -> np.ndarray:
    """The reference: (q [..., out, in], s) -> float32 w [..., in, out]."""
    q, s = np.asarray(q), np.asarray(s, np.float32)
    w = (q.astype(np.float32).reshape(*q.shape[:-1], -1, GROUP) * s[..., None]).reshape(q.shape)
    return np.swapaxes(w, -1, -2)


def linear_reference(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x [..., in] @ dequantize(q, s) in float64 numpy (the kernel's test oracle)."""
    return (np.asarray(x, np.float64) @ dequantize(q, s).astype(np.float64)).astype(np.float32)


def resolve_impl(impl: str, q: jax.Array) -> str:
    """"auto": the CPU kernel when the weights live on one CPU device and the kernel builds,
    else XLA. Decided once when the model is built (it is static in the compiled step)."""
    if impl not in IMPLS:
        raise ValueError(f"quantized linear impl must be one of {IMPLS}; got {impl!r}")
    if impl != "auto":
        return impl
    from jaxserve.cpu_kernels import on_one_cpu

    if on_one_cpu(q):
        from jaxserve.cpu_kernels.int8 import available

        if available():
            return "kernel"
    return "xla"


def dequantize_jnp(q: jax.Array, s: jax.Array, dtype: Any) -> jax.Array:
    """(q [..., out, in], s) -> [..., out, in] in `dtype`, inside jit (XLA fuses it into consumers)."""
    groups = q.reshape(*q.shape[:-1], -1, GROUP).astype(dtype) * s[..., None].astype(dtype)
    return groups.reshape(q.shape)


def linear(x: jax.Array, q: jax.Array, s: jax.Array, impl: str = "xla") -> jax.Array:
    """x [..., in] @ W with W given as int8 q [out, in] and scales s [out, in/32] -> [..., out]
    in x's dtype. impl: "kernel" (the CPU jax.ffi kernel, float32 math) or "xla"."""
    if impl == "kernel":
        from jaxserve.cpu_kernels.int8 import int8_matmul_cpu

        return int8_matmul_cpu(x.astype(jnp.float32), q, s).astype(x.dtype)
    # Weights stay int8 in memory; convert * scale feeds the dot (contracting both on `in`), which
    # XLA fuses on TPU/GPU instead of materialising a float copy of W.
    w = dequantize_jnp(q, s, x.dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def embed_rows(q: jax.Array, s: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    """Rows `ids` of a quantized embedding q [V, E], s [V, E/32], dequantized: gather then scale."""
    return dequantize_jnp(q[ids], s[ids], dtype)


def quantized_names(cfg: Any) -> tuple[str, ...]:
    """The parameters stored quantized for this model: every linear layer and the LM head (the
    embedding, when tied to it)."""
    if cfg.is_moe:
        raise ValueError("--quantization int8 does not support mixture-of-experts models yet "
                         f"({cfg.architecture}: expert weights are stacked for grouped matmuls); serve it unquantized")
    names = [n for n in LINEAR_PARAMS if n != "lm_head"]
    names.append("embed" if cfg.tie_word_embeddings else "lm_head")
    return tuple(names)


def param_shapes(cfg: Any, float_dtype: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Every parameter of the int8 model: name -> (shape, dtype); the quantized ones transposed,
    with their scales under name + "_scale"."""
    from jaxserve.models.llama import param_shapes as float_shapes

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    quantized = set(quantized_names(cfg))
    for name, shape in float_shapes(cfg).items():
        if name not in quantized:
            out[name] = (shape, jnp.dtype(float_dtype))
            continue
        qshape = shape if name == "embed" else (*shape[:-2], shape[-1], shape[-2])
        if qshape[-1] % GROUP:
            raise ValueError(f"int8 quantization needs every linear layer's input dimension to be a multiple of "
                             f"{GROUP}: {name} has {qshape[-1]} (shape {shape})")
        out[name] = (qshape, jnp.dtype(jnp.int8))
        out[name + SCALE_SUFFIX] = ((*qshape[:-1], qshape[-1] // GROUP), jnp.dtype(jnp.float32))
    return out


def quantize_params(cfg: Any, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float host params (model layout) -> the int8 model's params (see param_shapes)."""
    out = dict(params)
    for name in quantized_names(cfg):
        w = params[name]
        # The tied embedding [V, E] is the head's [out, in] already: quantize its transpose.
        q, s = quantize(np.swapaxes(w, -1, -2) if name == "embed" else w)
        out[name], out[name + SCALE_SUFFIX] = q, s
    return out


def dequantize_params(cfg: Any, params: dict[str, np.ndarray], names: tuple[str, ...] | None = None
                      ) -> dict[str, np.ndarray]:
    """The inverse of quantize_params for `names` (default: all): float host arrays back."""
    out = dict(params)
    for name in names or quantized_names(cfg):
        w = dequantize(params[name], params[name + SCALE_SUFFIX])
        out[name] = np.swapaxes(w, -1, -2) if name == "embed" else w
        del out[name + SCALE_SUFFIX]
    return out


def is_quantized(params: dict[str, Any]) -> bool:
    return any(k.endswith(SCALE_SUFFIX) for k in params)


def partition_spec(name: str, float_specs: dict[str, P]) -> P:
    """Sharding of a quantized param: the float weight's spec with its last two axes swapped
    (the storage is transposed); a scale follows its weight (groups lie along `in`, so a split of
    `in` splits whole groups when each shard's share is a multiple of 32). The embedding is stored
    in its own orientation."""
    base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
    spec = tuple(float_specs[base])
    if base == "embed":
        return P(*spec)
    return P(*spec[:-2], spec[-1], spec[-2])


def check_splittable(cfg: Any, tp: int) -> None:
    """Row-parallel layers split their input dimension, and with it the scale groups: each
    shard's share must hold whole groups."""
    if tp == 1:
        return
    for name, n_in in (("wo", cfg.num_heads * cfg.head_dim), ("w_down", cfg.intermediate_size)):
        if (n_in // tp) % GROUP:
            raise ValueError(f"--quantization int8 over {tp} devices: {name}'s input dimension {n_in} split {tp} "
                             f"ways is {n_in // tp} a device, not a multiple of the {GROUP}-element scale groups")


def weight_bytes(arrays: dict[str, Any]) -> int:
    return int(sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays.values()))
