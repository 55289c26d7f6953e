"""Meshes, partition rules and shardings for tensor (``model``) and data (``data``) parallelism.

A mesh "DxT" has axes ("data", "model"): D replicas, each splitting the model over T devices.
Inside a replica, q/k/v and gate/up are column-parallel, o and down row-parallel, the embedding and
the LM head vocab-parallel, norms replicated; XLA inserts the collectives of the sharded matmuls.
The KV pool is split over KV heads on ``model`` and attention runs per shard under ``shard_map``.

Every shard must hold whole heads, and each shard's query heads must use only its own KV heads.
When T does not divide the KV heads (SmolLM2: 9 query heads over 3 KV heads), the heads are laid
out again at load time: KV heads are repeated and/or padded with zero heads until T divides their
number, and each repeat serves an equal slice of its query heads, padded with zero heads (zero q
columns and zero o rows add exactly nothing). ``HeadLayout`` records the mapping.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.models.llama import ModelConfig

log = logging.getLogger(__name__)

MESH_AXES = ("data", "model")

# Partition spec of every parameter (layer-stacked ones have the layer axis first).
PARAM_SPECS: dict[str, P] = {
    "embed": P("model", None),  # [V, E] vocab-parallel
    "lm_head": P(None, "model"),  # [E, V] vocab-parallel
    "final_norm": P(),
    "attn_norm": P(),
    "mlp_norm": P(),
    "q_norm": P(),
    "k_norm": P(),
    "post_attn_norm": P(),  # Gemma's norms on the attention and MLP outputs
    "post_mlp_norm": P(),
    "wq": P(None, None, "model"),  # [L, E, H*D] column-parallel
    "wk": P(None, None, "model"),
    "wv": P(None, None, "model"),
    "bq": P(None, "model"),
    "bk": P(None, "model"),
    "bv": P(None, "model"),
    "wo": P(None, "model", None),  # [L, H*D, E] row-parallel
    "w_gate": P(None, None, "model"),  # [L, E, F] column-parallel
    "w_up": P(None, None, "model"),
    "w_down": P(None, "model", None),  # [L, F, E] row-parallel
    # Mixture of experts: expert parallelism over the same `model` axis (see moe.py and
    # docs/parallelism.md): each device holds X/T whole experts; the router is replicated.
    "router": P(),  # [L, E, X]
    "we_gate": P(None, "model", None, None),  # [L, X, E, F]
    "we_up": P(None, "model", None, None),
    "we_down": P(None, "model", None, None),  # [L, X, F, E]
    "ws_gate": P(None, None, "model"),  # Qwen2-MoE's shared expert: a dense MLP, tensor-parallel
    "ws_up": P(None, None, "model"),
    "ws_down": P(None, "model", None),
    "shared_gate": P(),  # [L, E]
}
# KV pool [L, num_pages, page_size, 2*KVH, D]: K/V interleaved on the head axis, split by heads.
KV_POOL_SPEC = P(None, None, None, "model", None)
# Inside the layer scan the pool is viewed as [L*num_pages, page_size, 2*KVH, D].
_POOL_VIEW_SPEC = P(None, None, "model", None)
_HEADS_SPEC = P(None, "model", None)  # q, k, v, attention output: [T, heads, D]


def parse_mesh(spec: str) -> tuple[int, int]:
    """'DxT' -> (D, T)."""
    parts = str(spec).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"mesh must look like 'DxT' (data x model, e.g. '1x4'), got {spec!r}")
    return int(parts[0]), int(parts[1])


def make_mesh(spec: str, devices: Sequence[Any] | None = None) -> Mesh:
    """The ("data", "model") mesh over the first D*T devices; a clear error when there are fewer."""
    data, model = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    if data * model > len(devices):
        raise ValueError(f"mesh {spec!r} needs {data * model} devices, but only {len(devices)} "
                         f"{devices[0].platform.upper()} device(s) are visible")
    return Mesh(np.array(devices[: data * model]).reshape(data, model), MESH_AXES)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1 x T) mesh per data-parallel replica."""
    return [Mesh(mesh.devices[d: d + 1], MESH_AXES) for d in range(mesh.devices.shape[0])]


@dataclass(frozen=True)
class HeadLayout:
    """Which original head each served head is: q_heads[i], kv_heads[j] (-1: a zero padding head)."""

    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]

    @property
    def is_identity(self) -> bool:
        return self.q_heads == tuple(range(len(self.q_heads))) and self.kv_heads == tuple(range(len(self.kv_heads)))


def head_layout(cfg: ModelConfig, tp: int) -> HeadLayout:
    """Served heads for a model split over `tp` devices.

    Each KV head is repeated r times, each repeat serving ceil(G / r) of its group's G query heads
    (zero heads pad the last), and zero "dummy" KV heads pad the count to a multiple of tp. The r
    chosen gives the fewest query heads per device (the attention work), then the fewest KV heads
    (the pool's memory). r = 1 and no padding when tp divides the KV heads.
    """
    kvh, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads

    def cost(r: int) -> tuple[int, int]:
        kv_per_device = -(-kvh * r // tp)
        return kv_per_device * -(-group // r), kv_per_device

    repeats = min(range(1, tp + 1), key=cost)
    per_repeat = -(-group // repeats)
    served_kv = cost(repeats)[1] * tp
    q_heads, kv_heads = [], []
    for j in range(served_kv):
        if j >= kvh * repeats:  # a dummy KV head: zero weights, all its query heads zero
            kv_heads.append(-1)
            q_heads += [-1] * per_repeat
            continue
        kv, r = divmod(j, repeats)
        kv_heads.append(kv)
        for i in range(per_repeat):
            within = r * per_repeat + i
            q_heads.append(kv * group + within if within < group else -1)
    return HeadLayout(tuple(q_heads), tuple(kv_heads))


def check_splittable(cfg: ModelConfig, tp: int) -> None:
    """The dimensions that are split without padding must divide by the model axis."""
    dims = []
    if cfg.is_moe:  # experts are split whole over the model axis; the shared expert like a dense MLP
        dims.append(("num_experts", cfg.num_experts))
        if cfg.shared_expert_intermediate_size:
            dims.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    else:
        dims.append(("intermediate_size", cfg.intermediate_size))
    dims.append(("vocab_size", cfg.vocab_size))
    for name, size in dims:
        if size % tp:
            raise ValueError(f"cannot split the model over {tp} devices: {name}={size} is not divisible by {tp}; "
                             f"choose a model axis that divides it")


def apply_head_layout(cfg: ModelConfig, params: dict[str, np.ndarray],
                      layout: HeadLayout) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Re-lay the head axes of the attention weights (host arrays) as `layout` says."""
    if layout.is_identity:
        return cfg, params
    D = cfg.head_dim
    q_src, kv_src = np.asarray(layout.q_heads), np.asarray(layout.kv_heads)

    def take_heads(w: np.ndarray, src: np.ndarray, axis: int) -> np.ndarray:
        heads = w.reshape(*w.shape[:axis], -1, D, *w.shape[axis + 1:])
        out = np.take(heads, np.maximum(src, 0), axis=axis)
        if (src < 0).any():
            index = [slice(None)] * out.ndim
            index[axis] = src < 0
            out[tuple(index)] = 0
        return out.reshape(*w.shape[:axis], len(src) * D, *w.shape[axis + 1:])

    out = dict(params)
    out["wq"] = take_heads(params["wq"], q_src, 2)
    out["wo"] = take_heads(params["wo"], q_src, 1)
    for name in ("wk", "wv"):
        out[name] = take_heads(params[name], kv_src, 2)
    if cfg.attention_bias:
        out["bq"] = take_heads(params["bq"], q_src, 1)
        out["bk"] = take_heads(params["bk"], kv_src, 1)
        out["bv"] = take_heads(params["bv"], kv_src, 1)
    return replace(cfg, num_heads=len(q_src), num_kv_heads=len(kv_src)), out


def describe_layout(cfg: ModelConfig, layout: HeadLayout, tp: int) -> str:
    q_pad = sum(h < 0 for h in layout.q_heads)
    kv = [h for h in layout.kv_heads if h >= 0]
    return (f"model axis {tp}: the model has {cfg.num_heads} query / {cfg.num_kv_heads} KV heads; serving "
            f"{len(layout.q_heads)} query heads ({q_pad} zero) over {len(layout.kv_heads)} KV heads (each KV head "
            f"repeated {len(kv) // cfg.num_kv_heads}x, {len(layout.kv_heads) - len(kv)} zero) so that every shard "
            f"holds whole heads: {len(layout.q_heads) // tp} query and {len(layout.kv_heads) // tp} KV heads per device")


def param_sharding(mesh: Mesh, name: str, quantized: bool = False) -> NamedSharding:
    """quantized: `name` is stored quantized and transposed, or is a scale or an offset (see
    jaxserve/quantization.py)."""
    if quantized or name.endswith(("_scale", "_offset")):
        from jaxserve.quantization import partition_spec

        return NamedSharding(mesh, partition_spec(name, PARAM_SPECS))
    return NamedSharding(mesh, PARAM_SPECS[name])


def shard_params(params: dict[str, np.ndarray], mesh: Mesh, dtype: Any) -> dict[str, jax.Array]:
    """Host arrays -> arrays sharded by the rules; each device receives only its own slice.
    Quantized weights (with a `name_scale` beside them), their scales and offsets keep their dtypes."""
    out = {}
    for name, host in params.items():
        quantized = name + "_scale" in params
        sharding = param_sharding(mesh, name, quantized)
        kind = host.dtype if quantized or name.endswith(("_scale", "_offset")) else np.dtype(dtype)

        def shard(index, host=host, kind=kind):
            return np.asarray(host[index], kind)

        # dtype given: on a multi-host mesh a process may hold no shard of this replica.
        out[name] = jax.make_array_from_callback(host.shape, sharding, shard, dtype=np.dtype(kind))
    return out


def kv_pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_POOL_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_attention(attention_fn: Callable[..., jax.Array], mesh: Mesh) -> Callable[..., jax.Array]:
    """Run an attention function per model shard: each shard sees its heads and its half of the pool."""

    def sharded(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs, *, k_new, v_new, **static):
        def local(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs, k_new, v_new):
            return attention_fn(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs,
                                k_new=k_new, v_new=v_new, **static)

        rep = P()
        return jax.shard_map(
            local, mesh=mesh, check_vma=False, out_specs=_HEADS_SPEC,
            in_specs=(_HEADS_SPEC, _POOL_VIEW_SPEC, rep, rep, rep, rep, _HEADS_SPEC, _HEADS_SPEC),
        )(q, kv_pages, kv_lens, page_tables, cu_q_lens, num_seqs, k_new, v_new)

    return sharded


def shard_kv_write(write_fn: Callable[..., jax.Array], mesh: Mesh) -> Callable[..., jax.Array]:
    """Scatter new K/V into the pool shard by shard (no shard ever sees another's heads)."""
    return jax.shard_map(write_fn, mesh=mesh, check_vma=False, out_specs=_POOL_VIEW_SPEC,
                         in_specs=(_POOL_VIEW_SPEC, _HEADS_SPEC, _HEADS_SPEC, P()))


def per_device_bytes(arrays: Sequence[jax.Array]) -> dict[str, int]:
    """Bytes each device holds of these arrays (from their addressable shards)."""
    totals: dict[str, int] = {}
    for a in arrays:
        for s in a.addressable_shards:
            totals[str(s.device)] = totals.get(str(s.device), 0) + s.data.nbytes
    return totals
