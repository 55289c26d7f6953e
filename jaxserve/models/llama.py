"""One Llama-family decoder in Flax NNX: Llama 2/3/3.1, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3 (text),
and the mixture-of-experts members Qwen3-MoE, Mixtral, Qwen2-MoE (the MLP swapped for ``moe.moe_mlp``).

Gemma 3 is the same decoder with switches (all off for the Llama family): local sliding-window and
global layers interleaved (``sliding_layers``, each kind with its own RoPE base), a query scale and
logit soft-capping, (1 + weight) RMSNorms, norms after attention and after the MLP, GELU, and
embeddings scaled by sqrt(hidden_size).

Layer weights are stacked on a leading layer axis and the layers run under ``lax.scan``: one
layer is compiled once, whatever the depth. The model knows nothing of serving: it takes token
ids, an ``AttentionMetadata`` and the KV pool, and returns hidden states and the updated pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import quantization as quant
from jaxserve.attention import AttentionMetadata, write_kv
from jaxserve.models.moe import MOE_LAYER_PARAMS, moe_mlp


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (num_experts > 0: every layer's MLP is a routed set of experts).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router: str = "softmax_topk"  # Qwen-MoE: softmax then top-k; "topk_softmax": Mixtral's order
    norm_topk_prob: bool = True  # renormalise the chosen k probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    # Gemma 3. sliding_layers: per layer, 1 = local (attends to the last `sliding_window` tokens,
    # RoPE base `rope_local_theta`), 0 = global (`rope_theta`, `rope_scaling`); empty: every layer
    # alike, windowed exactly when `sliding_window` is set (the Llama family).
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    rope_local_scaling: dict | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (None: head_dim)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma's 1 + w
    sandwich_norms: bool = False  # norms on the attention output and the MLP output too (Gemma)
    hidden_act: str = "silu"  # MLP activation: "silu" or "gelu_tanh"
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the model dtype (Gemma)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Float32 KV bytes one token takes over all layers (scale by dtype size / 4)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    @property
    def mixed_layers(self) -> bool:
        """Local and global layers both present: each layer picks its attention at run time."""
        return len(set(self.sliding_layers)) > 1

    def layer_window(self, local: bool) -> int | None:
        return self.sliding_window if local else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies, with Llama 3.1's frequency-dependent scaling when configured.
    local: those of Gemma's local (sliding-window) layers."""
    dim = cfg.head_dim
    theta, scaling = cfg.rope_theta, cfg.rope_scaling or {}
    if local and cfg.rope_local_theta is not None:
        theta, scaling = cfg.rope_local_theta, cfg.rope_local_scaling or {}
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = np.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in ("default",):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """HF-style (rotate-half) rotary embedding. x: [T, heads, D]."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """offset: scale by (offset + weight), computed in float32 (Gemma's 1 + w, as HF computes it)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    if offset:
        w = offset + w
    return (xf * w).astype(x.dtype)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter, by name: the contract between the model and the loaders."""
    L, E, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "embed": (cfg.vocab_size, E),
        "final_norm": (E,),
        "attn_norm": (L, E),
        "wq": (L, E, qd),
        "wk": (L, E, kvd),
        "wv": (L, E, kvd),
        "wo": (L, qd, E),
        "mlp_norm": (L, E),
    }
    if cfg.is_moe:
        X, Fe, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        # Experts stacked [L, X, ...] so that one grouped matmul indexes them by expert id.
        shapes.update(router=(L, E, X), we_gate=(L, X, E, Fe), we_up=(L, X, E, Fe), we_down=(L, X, Fe, E))
        if S:
            shapes.update(ws_gate=(L, E, S), ws_up=(L, E, S), ws_down=(L, S, E), shared_gate=(L, E))
    else:
        shapes.update(w_gate=(L, E, F), w_up=(L, E, F), w_down=(L, F, E))
    if cfg.attention_bias:
        shapes.update(bq=(L, qd), bk=(L, kvd), bv=(L, kvd))
    if cfg.qk_norm:
        shapes.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    if cfg.sandwich_norms:
        shapes.update(post_attn_norm=(L, E), post_mlp_norm=(L, E))
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    return shapes


LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down",
                "bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm") + MOE_LAYER_PARAMS
# The float [L, in, out] projections a decode-sized CPU step computes with the stacked kernel.
DENSE_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
DENSE_IMPLS = ("auto", "xla", "cpu_kernel")


def resolve_dense_impl(impl: str, w: jax.Array) -> str:
    """"auto": the CPU stacked kernel when float32 weights live on one CPU device and the kernel
    builds, else XLA. Decided once when the model is built (static in the compiled step)."""
    if impl not in DENSE_IMPLS:
        raise ValueError(f"dense linear impl must be one of {DENSE_IMPLS}; got {impl!r}")
    if impl != "auto":
        return impl
    from jaxserve.cpu_kernels import on_one_cpu

    if w.dtype == jnp.float32 and on_one_cpu(w):
        from jaxserve.cpu_kernels.stacked import available

        if available():
            return "cpu_kernel"
    return "xla"


class LlamaForCausalLM(nnx.Module):
    """Decoder with stacked layer weights. Parameters are ``nnx.Param`` attributes named as in
    ``param_shapes``; loaders fill them with ``load_params``."""

    def __init__(self, cfg: ModelConfig, dtype: Any = jnp.float32, *, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        self.dtype = dtype
        # How experts are computed ("auto": lax.ragged_dot on TPU/GPU, the tiled loop on CPU) and
        # the mesh their weights are split over (None: unsplit). Static, not parameters.
        self.moe_impl = "auto"
        self.expert_mesh = None
        # Weight-only quantization ("none" | "int8" | "gguf", see jaxserve/quantization.py) and how its
        # linear layers run ("kernel": the CPU jax.ffi kernel, "xla"). Static, set by from_arrays.
        self.quantization = "none"
        self.quant_impl = "xla"
        self.param_names: tuple[str, ...] = ()  # set by from_arrays where quantized weights change them
        # How float projections run in steps of few rows: "cpu_kernel" (jaxserve/cpu_kernels/
        # stacked_matmul.cc, reading the stacked weights in place) or "xla". Static, set by from_arrays.
        self.dense_impl = "xla"
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))
        self.inv_freq_local = nnx.Variable(jnp.asarray(rope_inv_freq(cfg, local=True)))
        rngs = rngs or nnx.Rngs(0)
        for name, shape in param_shapes(cfg).items():
            if name.endswith("norm"):
                value = jnp.full(shape, 1.0 - cfg.norm_offset, dtype)
            elif name.startswith("b"):
                value = jnp.zeros(shape, dtype)
            else:
                value = (jax.random.normal(rngs.params(), shape, jnp.float32) * 0.02).astype(dtype)
            setattr(self, name, nnx.Param(value))

    def load_params(self, params: dict[str, Any]) -> None:
        """Replace parameters by arrays of the right shape (and cast to the model dtype)."""
        shapes = param_shapes(self.cfg)
        missing = set(shapes) - set(params)
        if missing:
            raise ValueError(f"checkpoint is missing parameters: {sorted(missing)}")
        for name, shape in shapes.items():
            value = params[name]
            if tuple(value.shape) != shape:
                raise ValueError(f"parameter {name!r} has shape {tuple(value.shape)}, the config needs {shape}")
            getattr(self, name)[...] = jnp.asarray(value, self.dtype)

    @classmethod
    def from_arrays(cls, cfg: ModelConfig, params: dict[str, jax.Array], dtype: Any = jnp.float32,
                    inv_freq: jax.Array | None = None, quantization: str = "none",
                    quant_impl: str = "auto", dense_impl: str = "xla") -> "LlamaForCausalLM":
        """A model holding exactly these (already placed, possibly sharded) arrays: it is built
        abstractly first, so no device ever holds randomly initialised or full-size copies.
        quantization "int8" or "gguf": `params` with quantized weights laid out as in
        jaxserve/quantization.py."""
        model = nnx.eval_shape(lambda: cls(cfg, dtype))
        quant.check_method(quantization)
        # (wq missing: the check below names it)
        impl = quant.resolve_impl(quant_impl, params["wq"]) if quantization != "none" and "wq" in params else None
        if impl == "pallas_tpu":  # the TPU kernel reads float32 scales (GGUF's float16 ones widened, exact)
            params = {k: v.astype(jnp.float32) if k.endswith(("_scale", "_offset")) and v.dtype == jnp.float16
                      else v for k, v in params.items()}
        if quantization != "none":
            expected = quant.expected_params(cfg, dtype, params)
        else:
            expected = {name: (shape, jnp.dtype(dtype)) for name, shape in param_shapes(cfg).items()}
        missing = set(expected) - set(params)
        if missing:
            raise ValueError(f"checkpoint is missing parameters: {sorted(missing)}")
        for name, (shape, want) in expected.items():
            value = params[name]
            if tuple(value.shape) != shape or value.dtype != want:
                raise ValueError(f"parameter {name!r} is {value.dtype}{tuple(value.shape)}, "
                                 f"the config needs {want}{shape}")
            setattr(model, name, nnx.Param(value))
        model.quantization = quantization
        model.param_names = tuple(expected)
        if quantization != "none":
            model.quant_impl = impl
        else:
            model.dense_impl = resolve_dense_impl(dense_impl, params["wq"])
        if cfg.is_moe:
            from jaxserve.models.moe import expert_mesh_of

            model.expert_mesh = expert_mesh_of(params["we_gate"])
        local = jnp.asarray(rope_inv_freq(cfg, local=True))
        if inv_freq is None:
            inv_freq = jnp.asarray(rope_inv_freq(cfg))
        else:  # placed as the caller placed the global frequencies (replicated over a mesh)
            local = jax.device_put(local, inv_freq.sharding)
        model.inv_freq = nnx.Variable(inv_freq)
        model.inv_freq_local = nnx.Variable(local)
        return model

    def _param_names(self) -> list[str]:
        return list(self.param_names or param_shapes(self.cfg))

    def param_arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in self._param_names()}

    def _linear(self, x: jax.Array, p: dict[str, jax.Array], name: str, layer: jax.Array | None = None) -> jax.Array:
        """x @ p[name]: a float weight [in, out], or quantized q [out, in(/2)] with p[name + "_scale"]
        (and p[name + "_offset"]); with `layer`, p holds them stacked over layers."""
        scale = p.get(name + "_scale")
        if scale is None:
            return x @ p[name]
        return quant.linear(x, p[name], scale, p.get(name + "_offset"), self.quant_impl, layer=layer)

    def __call__(
        self,
        tokens: jax.Array,
        metadata: AttentionMetadata,
        kv_cache: jax.Array,
        attention_fn: Callable[..., jax.Array],
        kv_write_fn: Callable[..., jax.Array] = write_kv,
        page_size: int | None = None,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[jax.Array, ...]:
        """tokens [T]; kv_cache [L, num_pages, page_size, 2*KVH, D]. Returns hidden [T, E], new cache.
        (Sharded serving passes per-shard versions of attention_fn and kv_write_fn.) A pool in
        another layout ([L, num_pages, ...]) passes through to those functions as it is, with
        `page_size` given. With `aux_layers` (static), also the residual stream entering each of
        those layers, concatenated: [T, len(aux_layers) * E] (what an EAGLE-3 head reads)."""
        cfg = self.cfg
        L, num_pages = kv_cache.shape[:2]
        page_size = kv_cache.shape[2] if page_size is None else page_size
        T = tokens.shape[0]
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inv_freq = self.inv_freq[...]
        inv_freq_local = self.inv_freq_local[...]
        have = set(self._param_names())
        layer_params = {n: getattr(self, n)[...] for n in LAYER_PARAMS if n in have}
        layer_params.update({n + suffix: getattr(self, n + suffix)[...] for n in LAYER_PARAMS
                             for suffix in ("_scale", "_offset") if n + suffix in have})
        # Decode-sized steps on one CPU: the dense projections read the stacked weights in place
        # (the kernel); as scan inputs, XLA would copy every layer's slice of them first.
        from jaxserve.cpu_kernels.stacked import MAX_ROWS, stacked_matmul_cpu

        stacked = ({n: layer_params.pop(n) for n in DENSE_WEIGHTS if n in layer_params}
                   if self.dense_impl == "cpu_kernel" and T <= MAX_ROWS else {})
        # Quantized weights on the CPU and TPU kernels likewise, at every row count: they take the
        # whole stack and the layer index (a scan input's slice costs a copy of the layer's bytes).
        quant_stacked: dict[str, jax.Array] = {}
        if self.quant_impl in quant.STACKED_IMPLS:
            for n in LAYER_PARAMS:
                if n + "_scale" in layer_params:
                    quant_stacked.update({k: layer_params.pop(k) for k in (n, n + "_scale", n + "_offset")
                                          if k in layer_params})
        # The pool is viewed flat over layers: layer l's pages are l*num_pages + page. Gathers and
        # scatters then index one array, which XLA updates in place inside the scan carry.
        pool = kv_cache.reshape(L * num_pages, *kv_cache.shape[2:])
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        act = ACTIVATIONS[cfg.hidden_act]
        # Local/global layers (Gemma 3): a per-layer flag picks the RoPE frequencies and, through
        # lax.cond, one of two attention calls, each with a static window: every backend unchanged.
        # Without a mix, the one kind is static (Llama family: windowed iff sliding_window is set).
        local_flags = jnp.asarray(cfg.sliding_layers, jnp.int32) if cfg.mixed_layers else None
        static_local = bool(cfg.sliding_layers[0]) if cfg.sliding_layers else cfg.sliding_window is not None

        def attend(local: bool):
            def run(q, pool, k, v, l):
                return attention_fn(
                    q, pool, metadata.kv_lens, metadata.page_tables + l * num_pages,
                    metadata.cu_q_lens, metadata.num_seqs, k_new=k, v_new=v,
                    sm_scale=cfg.attention_scale, sliding_window=cfg.layer_window(local),
                    soft_cap=cfg.attn_logit_softcap,
                )
            return run

        aux_ids = jnp.asarray(aux_layers, jnp.int32)

        def layer(carry, xs):
            x, pool, aux = carry
            p, l = xs
            if aux_layers:  # keep the stream entering the chosen layers (a select: no dynamic index)
                aux = jnp.where((aux_ids == l)[:, None, None], x[None], aux)

            def mm(h: jax.Array, p: dict[str, jax.Array], name: str) -> jax.Array:
                if name in stacked:
                    return stacked_matmul_cpu(h, stacked[name], l)
                if name in quant_stacked:
                    return self._linear(h, quant_stacked, name, layer=l)
                return self._linear(h, p, name)

            h = rms_norm(x, p["attn_norm"], eps, offset)
            q, k, v = mm(h, p, "wq"), mm(h, p, "wk"), mm(h, p, "wv")
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k, v = q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
            if cfg.qk_norm:
                q = rms_norm(q, p["q_norm"], eps, offset)
                k = rms_norm(k, p["k_norm"], eps, offset)
            if local_flags is not None:
                is_local = local_flags[l]
                freqs = jnp.where(is_local > 0, inv_freq_local, inv_freq)
            else:
                freqs = inv_freq_local if static_local and cfg.sliding_layers else inv_freq
            q = apply_rope(q, metadata.positions, freqs)
            k = apply_rope(k, metadata.positions, freqs)
            pool = kv_write_fn(pool, k, v, metadata.slot_mapping + l * num_pages * page_size)
            if local_flags is not None:
                attn = jax.lax.cond(is_local > 0, attend(True), attend(False), q, pool, k, v, l)
            else:
                attn = attend(static_local)(q, pool, k, v, l)
            o = mm(attn.reshape(T, H * D).astype(x.dtype), p, "wo")
            if cfg.sandwich_norms:
                o = rms_norm(o, p["post_attn_norm"], eps, offset)
            x = x + o
            h = rms_norm(x, p["mlp_norm"], eps, offset)
            if cfg.is_moe:
                m = moe_mlp(h, p, cfg, impl=self.moe_impl, mesh=self.expert_mesh).astype(x.dtype)
            else:
                m = mm(act(mm(h, p, "w_gate")) * mm(h, p, "w_up"), p, "w_down")
            if cfg.sandwich_norms:
                m = rms_norm(m, p["post_mlp_norm"], eps, offset)
            x = x + m
            return (x, pool, aux), None

        if "embed_scale" in self._param_names():  # a quantized embedding: its rows, dequantized
            from jaxserve.quantization import embed_rows

            embed_offset = self.embed_offset[...] if "embed_offset" in self._param_names() else None
            x = embed_rows(self.embed[...], self.embed_scale[...], embed_offset, tokens, self.dtype)
        else:
            x = self.embed[...][tokens].astype(self.dtype)
        if cfg.embed_scale:  # HF casts the normaliser to the model dtype first (sqrt(3072) -> 55.5 in bf16)
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), self.dtype)
        aux = jnp.zeros((len(aux_layers), T, cfg.hidden_size), x.dtype)
        (x, pool, aux), _ = jax.lax.scan(layer, (x, pool, aux), (layer_params, jnp.arange(L, dtype=jnp.int32)))
        hidden = rms_norm(x, self.final_norm[...], eps, offset)
        if aux_layers:
            return hidden, pool.reshape(kv_cache.shape), jnp.concatenate(list(aux), axis=-1)
        return hidden, pool.reshape(kv_cache.shape)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, E] -> float32 logits [N, V]."""
        name = "embed" if self.cfg.tie_word_embeddings else "lm_head"
        have = self._param_names()
        if name + "_scale" in have:
            arrays = {n: getattr(self, n)[...] for n in (name, name + "_scale", name + "_offset") if n in have}
            logits = self._linear(hidden, arrays, name).astype(jnp.float32)
        else:
            head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
            logits = (hidden @ head).astype(jnp.float32)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
