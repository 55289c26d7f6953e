"""Mixture-of-experts MLP: routing, tokens grouped by expert, a grouped matmul, weighted combine.

One layer's flow, for T tokens and top-k routing over X experts:
  1. router logits h @ router [T, X] -> (weights, expert ids) [T, k], as the family defines it;
  2. the T*k (token, expert) rows are sorted by expert id: each expert's rows are contiguous,
     ``group_sizes[x]`` of them;
  3. a grouped FFN over the sorted rows: row r is multiplied by its own expert's weights only, so
     the FLOPs are those of the routed experts (T*k rows), not of all X experts (T*X rows);
  4. rows are unsorted, scaled by their routing weight and summed over k back into [T, E].

Grouped matmul implementations (``impl``):
  - "ragged_dot": ``jax.lax.ragged_dot``. TPU lowers it to its native grouped matmul. Its default
    lowering (CPU, read in jax 0.10.2's lax.py) masks the rows into a [groups, rows, K] operand and
    runs one dense dot: every row times every expert, X times the routed FLOPs.
  - "tiled": our loop over row tiles of B rows, each tile belonging to one expert (a group's last
    tile is partly masked): sum_x ceil(n_x / B) tiles, so under X*B rows of waste, B from
    ``tile_rows`` (8 for decode batches, ~the mean rows per expert for prefill). The CPU path.
  - "dense": every expert on every token, combined with zero weight for the unrouted ones. The
    reference the grouped versions are measured against.
  - "auto": "ragged_dot" on TPU/GPU, "tiled" on CPU.

Expert parallelism: when the expert weights are split over a mesh axis (``expert_mesh_of``), each
device runs only its own experts on the tokens routed to them and the partial outputs are summed
over the axis (``psum``). Under tensor parallelism the activations are already replicated over
that axis, so no token needs to move before the experts; the one collective is the all-reduce a
row-parallel dense MLP also pays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

if TYPE_CHECKING:
    from jaxserve.models.llama import ModelConfig

MOE_LAYER_PARAMS = ("router", "we_gate", "we_up", "we_down", "ws_gate", "ws_up", "ws_down", "shared_gate")
ROUTERS = ("softmax_topk", "topk_softmax")
IMPLS = ("auto", "ragged_dot", "tiled", "dense")
TILE_ROWS = 8  # the smallest tile of the "tiled" loop (decode-sized batches)
MAX_TILE_ROWS = 128


def tile_rows(rows: int, groups: int) -> int:
    """Tile height for `rows` sorted rows over `groups` experts: about one tile per expert at the
    mean load (few loop trips, matmuls tall enough to run well), at least TILE_ROWS. The waste is
    below groups * tile rows, so about one extra expert's share of rows in total."""
    mean = max(1, rows // max(1, groups))
    return int(min(MAX_TILE_ROWS, max(TILE_ROWS, 1 << (mean - 1).bit_length())))


def route(logits: jax.Array, k: int, router: str, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, X] -> float32 weights [T, k] and int32 expert ids [T, k]."""
    logits = logits.astype(jnp.float32)
    if router == "topk_softmax":  # Mixtral: top-k of the logits, softmax over the chosen k
        top, ids = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
    if router != "softmax_topk":
        raise ValueError(f"router {router!r} is not one of {ROUTERS}")
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)  # Qwen-MoE
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"moe impl {impl!r} is not one of {IMPLS}")
    if impl == "auto":
        # Read at trace time: the backend the step is compiled for.
        return "ragged_dot" if jax.default_backend() in ("tpu", "gpu") else "tiled"
    return impl


def _ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _tiled_ffn(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               group_sizes: jax.Array, tile: int) -> jax.Array:
    """Grouped FFN over rows sorted by group: a loop over B-row tiles, one expert's weights per tile.
    The trip count is dynamic (the number of non-empty tiles), so empty experts cost nothing."""
    M, E = xs.shape
    B = max(1, min(tile, M))
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles = (group_sizes + B - 1) // B
    tile_ends = jnp.cumsum(tiles)
    # B rows of padding: a tile that starts near the end is sliced whole (dynamic_slice would
    # otherwise clamp its start and shift the rows).
    xs_p = jnp.pad(xs, ((0, B), (0, 0)))
    out = jnp.zeros((M + B, w_down.shape[-1]), xs.dtype)
    offsets = jnp.arange(B, dtype=group_sizes.dtype)

    def body(t: jax.Array, out: jax.Array) -> jax.Array:
        g = jnp.searchsorted(tile_ends, t, side="right")  # the group tile t belongs to
        r0 = starts[g] + (t - (tile_ends[g] - tiles[g])) * B
        rows = jax.lax.dynamic_slice_in_dim(xs_p, r0, B)
        y = _ffn(rows, w_gate[g], w_up[g], w_down[g])
        valid = (r0 + offsets < ends[g])[:, None]  # the rest of the tile is the next group's
        current = jax.lax.dynamic_slice_in_dim(out, r0, B)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(valid, y, current), r0, 0)

    return jax.lax.fori_loop(0, tile_ends[-1], body, out)[:M]


def grouped_ffn(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                group_sizes: jax.Array, impl: str) -> jax.Array:
    """Rows xs [M, E] sorted by group; row r uses the weights of its group. Rows past
    sum(group_sizes) come back as zeros. w_gate/w_up [G, E, F], w_down [G, F, E]."""
    if impl == "ragged_dot":
        g = jax.lax.ragged_dot(xs, w_gate, group_sizes)
        u = jax.lax.ragged_dot(xs, w_up, group_sizes)
        return jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down, group_sizes)
    if impl == "tiled":
        return _tiled_ffn(xs, w_gate, w_up, w_down, group_sizes, tile_rows(xs.shape[0], w_gate.shape[0]))
    raise ValueError(f"grouped_ffn impl must be 'ragged_dot' or 'tiled', got {impl!r}")


def routed_experts(h: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, impl: str, first_expert: jax.Array | int = 0) -> jax.Array:
    """sum_k weights[t, k] * FFN_{ids[t, k]}(h[t]) over the experts held here: ids in
    [first_expert, first_expert + G), G = w_gate.shape[0]. Others contribute zero (expert parallel)."""
    T, k = ids.shape
    G = w_gate.shape[0]
    if impl == "dense":
        local = ids - first_expert
        local = jnp.where((local >= 0) & (local < G), local, G)  # not here: G, out of bounds (a negative would wrap)
        dense_w = jnp.zeros((T, G), jnp.float32).at[jnp.arange(T)[:, None], local].add(weights, mode="drop")
        gate = jnp.einsum("te,gef->tgf", h, w_gate)
        up = jnp.einsum("te,gef->tgf", h, w_up)
        out = jnp.einsum("tgf,gfe->tge", jax.nn.silu(gate) * up, w_down)
        return jnp.einsum("tg,tge->te", dense_w.astype(out.dtype), out)
    local = ids.reshape(-1) - first_expert
    local = jnp.where((local >= 0) & (local < G), local, G)  # G: "not here", sorted last
    order = jnp.argsort(local, stable=True)  # sorted row -> flat (token, k) slot
    group_sizes = jnp.bincount(local, length=G + 1)[:G].astype(jnp.int32)
    ys = grouped_ffn(h[order // k], w_gate, w_up, w_down, group_sizes, impl)
    ys = ys * weights.reshape(-1)[order][:, None].astype(ys.dtype)
    # Unsort with a gather (the inverse permutation), then sum each token's k rows.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return ys[inverse].reshape(T, k, -1).sum(axis=1)


def expert_mesh_of(w: Any) -> jax.sharding.Mesh | None:
    """The mesh an expert weight [L, X, ...] is split over on its expert axis, if it is."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * 2
    axis = spec[1]
    if axis is None or sharding.mesh.shape[axis] == 1:
        return None
    return sharding.mesh


def moe_mlp(h: jax.Array, p: dict[str, jax.Array], cfg: "ModelConfig", impl: str = "auto",
            mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """One layer's MoE MLP. h [T, E]; p holds that layer's router [E, X], we_* [X, ...] (and the
    shared expert's ws_*, shared_gate [E] when configured). mesh: split experts over its "model"
    axis (see expert_mesh_of)."""
    impl = resolve_impl(impl)
    logits = jnp.dot(h, p["router"], preferred_element_type=jnp.float32)
    weights, ids = route(logits, cfg.num_experts_per_tok, cfg.router, cfg.norm_topk_prob)
    if mesh is None:
        out = routed_experts(h, weights, ids, p["we_gate"], p["we_up"], p["we_down"], impl)
    else:
        out = _expert_parallel(h, weights, ids, p["we_gate"], p["we_up"], p["we_down"], impl, mesh)
    if cfg.shared_expert_intermediate_size:
        gate = jax.nn.sigmoid(jnp.dot(h, p["shared_gate"], preferred_element_type=jnp.float32))
        out = out + _ffn(h, p["ws_gate"], p["ws_up"], p["ws_down"]) * gate[:, None].astype(h.dtype)
    return out


EXPERT_AXIS = "model"


def _expert_parallel(h: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                     w_down: jax.Array, impl: str, mesh: jax.sharding.Mesh) -> jax.Array:
    """Each device: its X/N experts on the (replicated) tokens routed to them; psum the partials."""
    experts = P(EXPERT_AXIS, None, None)

    def local(h, weights, ids, w_gate, w_up, w_down):
        first = jax.lax.axis_index(EXPERT_AXIS) * w_gate.shape[0]
        part = routed_experts(h, weights, ids, w_gate, w_up, w_down, impl, first_expert=first)
        return jax.lax.psum(part, EXPERT_AXIS)

    return jax.shard_map(local, mesh=mesh, check_vma=False, out_specs=P(),
                         in_specs=(P(), P(), P(), experts, experts, experts))(h, weights, ids, w_gate, w_up, w_down)
