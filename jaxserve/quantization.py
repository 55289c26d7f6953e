"""Weight-only quantization: ``--quantization int8`` (any checkpoint) and ``gguf`` (a GGUF's own).

Every quantized weight is stored in groups of 32 consecutive *input* elements of an output, with
one scale per group and, for the affine formats, one offset (float32, or float16 as GGUF's Q8_0,
Q4_0 and Q4_1 store them):
``w[k, o] ~ value(q)[o, k] * s[o, k // 32] (+ m[o, k // 32])``. Formats (the array dtypes say which):
- int8 q [.., out, in], no offsets: GGUF Q8_0 served as it is.
- int8 q with offsets: ``--quantization int8``. Each group's [min, max] maps onto -128..127
  (``s = (max - min) / 255``, ``m = min + 128 s``). Symmetric groups (``s = max|w| / 127``) were
  tried first: 1.40% of greedy tokens flipped on the default model, affine 0.52% (see
  docs/quantization.md). One scale per output channel flipped 34%: its weights come from Q4_1,
  whose blocks are 32 inputs wide, and such scales smear one block's outliers over all of them.
- uint8 q [.., out, in / 2] of packed 4-bit values with offsets: GGUF Q4_1, Q4_0 (with
  ``m = -8 s``) and Q4_K (a group per 32-value sub-block) served as they are. A group's 16 bytes
  hold its elements i (low nibble) and i + 16 (high nibble), GGUF's own order for Q4_0/Q4_1, so
  their bytes are copied, never dequantized.

Layout: a model weight ``[..., in, out]`` is stored transposed, ``q [..., out, in]``,
``s`` and ``m`` ``[..., out, in/32]``, so that each output's weights and its scales are contiguous
(the CPU kernel streams them in order). A tied embedding ``[V, E]`` is already ``[out, in]`` for the
LM head: one quantized array serves the head (a linear) and the embedding (gather + dequantize rows).

``linear(x, q, s, m)`` is what the model calls: on one CPU device the ``jax.ffi`` kernel
(``cpu_kernels/quant_matmul.cc``); on one TPU device the Pallas kernel
(``pallas_kernels/quant_matmul_tpu.py``, weight tiles dequantized in VMEM); elsewhere (GPU, meshes)
XLA with the weights quantized in memory and the dequantization (convert * scale + offset) in the
jitted step. XLA does not fuse the group scale into the dot there: it writes a float copy of W per
call (tests/test_quant_compile.py).
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
METHODS = ("none", "int8", "gguf")
# Model weights [.., in, out] quantized as linear layers. The MoE expert stacks are not (refused).
LINEAR_PARAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")
SCALE_SUFFIX = "_scale"
OFFSET_SUFFIX = "_offset"
IMPLS = ("auto", "kernel", "pallas_tpu", "xla")
STACKED_IMPLS = ("kernel", "pallas_tpu")  # read one layer of the stacked weights in place
QUANT_CACHE_TAG = "int8-g32-affine-v2"  # in the converted-weights cache key: bump when the scheme changes


def check_method(method: str | None) -> str:
    method = "none" if method is None else str(method)
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {method!r}")
    return method


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [..., in, out] float -> affine int8 (q [..., out, in], s, m [..., out, in/32] float32)."""
    w = np.asarray(w, np.float32)
    n_in = w.shape[-2]
    if n_in % GROUP:
        raise ValueError(f"int8 quantization needs the input dimension to be a multiple of {GROUP}; "
                         f"a weight of shape {w.shape} has {n_in}")
    wt = np.swapaxes(w, -1, -2)  # [..., out, in]
    groups = wt.reshape(*wt.shape[:-1], n_in // GROUP, GROUP)
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    scale = (hi - lo) / np.float32(255.0)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)  # constant groups: q = -128, w = m
    q = np.clip(np.rint((groups - lo[..., None]) * inv[..., None]) - 128, -128, 127).astype(np.int8)
    offset = lo + np.float32(128.0) * scale
    return q.reshape(wt.shape), scale.astype(np.float32), offset.astype(np.float32)


def unpack_q4(q: np.ndarray) -> np.ndarray:
    """Packed 4-bit uint8 [..., out, in/2] -> the values 0..15 as uint8 [..., out, in]."""
    q = np.asarray(q, np.uint8)
    b = q.reshape(*q.shape[:-1], -1, GROUP // 2)
    return np.concatenate([b & 15, b >> 4], axis=-1).reshape(*q.shape[:-1], -1)


def pack_q4(values: np.ndarray) -> np.ndarray:
    """The inverse of unpack_q4: values 0..15 [..., out, in] -> uint8 [..., out, in/2]."""
    v = np.asarray(values, np.uint8).reshape(*values.shape[:-1], -1, GROUP)
    return (v[..., : GROUP // 2] | (v[..., GROUP // 2:] << 4)).reshape(*values.shape[:-1], -1)


def dequantize(q: Any, s: Any, m: Any = None) -> np.ndarray:
    """The reference: (q [..., out, in(/2)], s, m) -> float32 w [..., in, out]."""
    q, s = np.asarray(q), np.asarray(s, np.float32)
    values = unpack_q4(q) if q.dtype == np.uint8 else q
    groups = values.astype(np.float32).reshape(*values.shape[:-1], -1, GROUP) * s[..., None]
    if m is not None:
        groups = groups + np.asarray(m, np.float32)[..., None]
    return np.swapaxes(groups.reshape(values.shape), -1, -2)


def linear_reference(x: np.ndarray, q: np.ndarray, s: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """x [..., in] @ dequantize(q, s, m) in float64 numpy (the kernel's test oracle)."""
    return (np.asarray(x, np.float64) @ dequantize(q, s, m).astype(np.float64)).astype(np.float32)


def on_one_tpu(q: Any) -> bool:
    """Whether array q lives on a single TPU device (not a mesh)."""
    from jaxserve.cpu_kernels import on_one_device

    return on_one_device(q, "tpu")


def resolve_impl(impl: str, q: jax.Array) -> str:
    """"auto": the CPU kernel when the weights live on one CPU device and the kernel builds; the
    Pallas TPU kernel when they live on one TPU device; else XLA (GPU, and meshes: the TPU kernel
    is not wrapped in shard_map yet). Decided once when the model is built (static in the step)."""
    if impl not in IMPLS:
        raise ValueError(f"quantized linear impl must be one of {IMPLS}; got {impl!r}")
    if impl != "auto":
        return impl
    from jaxserve.cpu_kernels import on_one_cpu

    if on_one_cpu(q):
        from jaxserve.cpu_kernels.quant_matmul import available

        if available():
            return "kernel"
    if on_one_tpu(q):
        return "pallas_tpu"
    return "xla"


def dequantize_jnp(q: jax.Array, s: jax.Array, m: jax.Array | None, dtype: Any) -> jax.Array:
    """(q [..., out, in(/2)], s, m) -> [..., out, in] in `dtype`, inside jit (XLA fuses it into
    consumers)."""
    if q.dtype == jnp.uint8:  # packed 4-bit: a group's low nibbles are its first 16 elements
        b = q.reshape(*q.shape[:-1], -1, GROUP // 2)
        values = jnp.concatenate([b & 15, b >> 4], axis=-1)
    else:
        values = q.reshape(*q.shape[:-1], -1, GROUP)
    groups = values.astype(dtype) * s[..., None].astype(dtype)
    if m is not None:
        groups = groups + m[..., None].astype(dtype)
    return groups.reshape(*q.shape[:-1], -1)


def linear(x: jax.Array, q: jax.Array, s: jax.Array, m: jax.Array | None = None, impl: str = "xla",
           layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ W with W given as q [out, in] int8 (or [out, in/2] packed 4-bit), scales
    s [out, in/32] and optional offsets m -> [..., out] in x's dtype. impl: "kernel" (the CPU
    jax.ffi kernel, float32 math), "pallas_tpu" (tiles dequantized in VMEM, float32 accumulation)
    or "xla". layer: q, s, m are stacked over layers and this (traced) index picks one; the
    kernels read it in place."""
    if impl == "kernel":
        from jaxserve.cpu_kernels.quant_matmul import quant_matmul_cpu

        return quant_matmul_cpu(x.astype(jnp.float32), q, s, m, layer).astype(x.dtype)
    if impl == "pallas_tpu":
        from jaxserve.pallas_kernels.quant_matmul_tpu import quant_matmul_tpu

        y = quant_matmul_tpu(x.reshape(-1, x.shape[-1]), q, s, m, layer)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if layer is not None:
        q, s, m = q[layer], s[layer], None if m is None else m[layer]
    # Weights stay quantized in memory; convert * scale (+ offset) feeds the dot (contracting both
    # on `in`). XLA fuses a bare convert into the dot on TPU/GPU but not the group scale: it
    # materialises a float W per call (tests/test_quant_compile.py); a Pallas kernel is the fix.
    w = dequantize_jnp(q, s, m, x.dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def embed_rows(q: jax.Array, s: jax.Array, m: jax.Array | None, ids: jax.Array, dtype: Any) -> jax.Array:
    """Rows `ids` of a quantized embedding q [V, E(/2)], s [V, E/32], dequantized: gather, then scale."""
    return dequantize_jnp(q[ids], s[ids], None if m is None else m[ids], dtype)


def quantized_names(cfg: Any) -> tuple[str, ...]:
    """The parameters --quantization int8 stores quantized: every linear layer and the LM head
    (the embedding, when tied to it)."""
    if cfg.is_moe:
        raise ValueError("--quantization int8 does not support mixture-of-experts models yet "
                         f"({cfg.architecture}: expert weights are stacked for grouped matmuls); serve it unquantized")
    names = [n for n in LINEAR_PARAMS if n != "lm_head"]
    names.append("embed" if cfg.tie_word_embeddings else "lm_head")
    return tuple(names)


def names_in(params: dict[str, Any]) -> tuple[str, ...]:
    """The quantized parameters of a params dict (those with a scale)."""
    return tuple(k[: -len(SCALE_SUFFIX)] for k in params if k.endswith(SCALE_SUFFIX))


def param_shapes(cfg: Any, float_dtype: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Every parameter of the --quantization int8 model: name -> (shape, dtype); the quantized
    ones transposed, with their scales and offsets under name + "_scale" and + "_offset"."""
    from jaxserve.models.llama import param_shapes as float_shapes

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    quantized = set(quantized_names(cfg))
    for name, shape in float_shapes(cfg).items():
        if name not in quantized:
            out[name] = (shape, jnp.dtype(float_dtype))
            continue
        qshape = _stored_shape(name, shape)
        if qshape[-1] % GROUP:
            raise ValueError(f"int8 quantization needs every linear layer's input dimension to be a multiple of "
                             f"{GROUP}: {name} has {qshape[-1]} (shape {shape})")
        out[name] = (qshape, jnp.dtype(jnp.int8))
        for suffix in (SCALE_SUFFIX, OFFSET_SUFFIX):
            out[name + suffix] = ((*qshape[:-1], qshape[-1] // GROUP), jnp.dtype(jnp.float32))
    return out


def _stored_shape(name: str, float_shape: tuple[int, ...]) -> tuple[int, ...]:
    """A float weight's shape as stored quantized: [..., out, in] (the embedding as it is)."""
    return tuple(float_shape) if name == "embed" else (*float_shape[:-2], float_shape[-1], float_shape[-2])


def expected_params(cfg: Any, float_dtype: Any, params: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """name -> (shape, dtype) of every parameter a quantized model holds, given which of them
    `params` holds quantized (any format: int8 with or without offsets, packed 4-bit with them);
    raises if a quantized weight's arrays do not fit the config."""
    from jaxserve.models.llama import param_shapes as float_shapes

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for name, shape in float_shapes(cfg).items():
        if name + SCALE_SUFFIX not in params:
            out[name] = (shape, jnp.dtype(float_dtype))
            continue
        qshape = _stored_shape(name, shape)
        packed = name in params and params[name].dtype == jnp.uint8
        out[name] = ((*qshape[:-1], qshape[-1] // 2) if packed else qshape,
                     jnp.dtype(jnp.uint8 if packed else jnp.int8))
        # Scales and offsets: float32, or float16 as GGUF's Q8_0 / Q4_0 / Q4_1 store them.
        scale_dtype = params[name + SCALE_SUFFIX].dtype
        groups = ((*qshape[:-1], qshape[-1] // GROUP),
                  jnp.dtype(jnp.float16 if scale_dtype == jnp.float16 else jnp.float32))
        out[name + SCALE_SUFFIX] = groups
        if packed or name + OFFSET_SUFFIX in params:
            out[name + OFFSET_SUFFIX] = groups
    return out


def quantize_params(cfg: Any, params: dict[str, np.ndarray], names: tuple[str, ...] | None = None
                    ) -> dict[str, np.ndarray]:
    """Float host params (model layout) -> the int8 model's params (see param_shapes), for
    `names` (default: quantized_names)."""
    out = dict(params)
    for name in names or quantized_names(cfg):
        w = params[name]
        # The tied embedding [V, E] is the head's [out, in] already: quantize its transpose.
        q, s, m = quantize(np.swapaxes(w, -1, -2) if name == "embed" else w)
        out[name], out[name + SCALE_SUFFIX], out[name + OFFSET_SUFFIX] = q, s, m
    return out


def dequantize_params(params: dict[str, np.ndarray], names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """Quantized weights `names` (default: all) back to float32 host arrays in the model layout."""
    out = dict(params)
    for name in names or names_in(params):
        w = dequantize(params[name], params[name + SCALE_SUFFIX], params.get(name + OFFSET_SUFFIX))
        out[name] = np.swapaxes(w, -1, -2) if name == "embed" else w
        del out[name + SCALE_SUFFIX]
        out.pop(name + OFFSET_SUFFIX, None)
    return out


def is_quantized(params: dict[str, Any]) -> bool:
    return any(k.endswith(SCALE_SUFFIX) for k in params)


def partition_spec(name: str, float_specs: dict[str, P]) -> P:
    """Sharding of a quantized param: the float weight's spec with its last two axes swapped
    (the storage is transposed); scales and offsets follow their weight (groups lie along `in`,
    so a split of `in` splits whole groups when each shard's share is a multiple of 32). The
    embedding is stored in its own orientation."""
    base = name
    for suffix in (SCALE_SUFFIX, OFFSET_SUFFIX):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
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
            raise ValueError(f"quantized weights over {tp} devices: {name}'s input dimension {n_in} split {tp} "
                             f"ways is {n_in // tp} a device, not a multiple of the {GROUP}-element scale groups")


def describe(params: dict[str, Any], float_dtype: Any) -> str:
    """One line for the start-up log: each quantized weight's format, and the bytes against float."""
    kinds: dict[str, list[str]] = {}
    float_bytes = 0
    for name in names_in(params):
        q = params[name]
        kind = ("4-bit + offsets" if q.dtype == np.uint8 else
                "int8 + offsets" if name + OFFSET_SUFFIX in params else "int8")
        kinds.setdefault(kind, []).append(name)
        float_bytes += int(params[name + SCALE_SUFFIX].size) * GROUP * np.dtype(float_dtype).itemsize
    stored = sum(int(np.asarray(a).nbytes) for a in params.values())
    float_bytes += sum(int(np.asarray(a).nbytes) for k, a in params.items()
                       if not k.endswith((SCALE_SUFFIX, OFFSET_SUFFIX)) and k + SCALE_SUFFIX not in params)
    formats = "; ".join(f"{kind} ({', '.join(names)})" for kind, names in kinds.items())
    return (f"{formats}; a scale per {GROUP} inputs; weights {stored / 2**20:.1f} MiB, "
            f"{np.dtype(float_dtype).name} would be {float_bytes / 2**20:.1f} MiB")


def weight_bytes(arrays: dict[str, Any]) -> int:
    return int(sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays.values()))
