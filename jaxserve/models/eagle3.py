"""An EAGLE-3 draft head (Li et al., 2025) in Flax NNX, loaded from the published checkpoint format.

The head is one decoder layer that drafts from the target model's own features. At position p
it reads the embedding of token p + 1 and a hidden state h_p, and predicts token p + 2:

    e = input_norm(embed(token))          h = hidden_norm(h_p)       residual = h_p
    a = attention(concat(e, h))           (q, k, v project 2E inputs; RoPE; its own KV cache)
    x = a + residual;  m = mlp(post_attention_norm(x));  prenorm = m + x
    logits over the draft vocabulary = lm_head(norm(prenorm)); draft id d is target token d + d2t[d]

h_p is, for a position the target computed, `fc` of the target's residual stream entering three of
its layers (concatenated, [3 * E_target]); for a drafted position, the head's own `prenorm` of the
position before. The model knows nothing of serving: it takes tokens, hidden states, attention
metadata and a one-layer KV pool, as the target model does.

Checkpoint (a directory, as the EAGLE-3 authors and SpecForge publish them): config.json
(`architectures: ["LlamaForCausalLMEagle3"]`, hidden_size, heads, intermediate_size, `draft_vocab_size`,
`target_hidden_size`, optionally `eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with
`fc.weight`, `midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight`, `d2t` (and `t2d`, unused), optionally `embed_tokens.weight` (else the target's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.attention import AttentionMetadata, write_kv
from jaxserve.models.llama import ACTIVATIONS, ModelConfig, apply_rope, rms_norm, rope_inv_freq

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    aux_layer_ids: tuple[int, ...] | None = None  # None: the target's (2, L // 2, L - 3)
    norm_before_residual: bool = False  # the residual is hidden_norm(h) instead of h

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Eagle3Config":
        arch = (hf.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"not an EAGLE-3 head: architecture {arch!r} (expected one of {ARCHITECTURES})")
        if hf.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 heads with {hf['num_hidden_layers']} layers are not supported (one layer)")
        E = hf["hidden_size"]
        H = hf["num_attention_heads"]
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(hidden_size=E, intermediate_size=hf["intermediate_size"], num_heads=H,
                   num_kv_heads=hf.get("num_key_value_heads") or H, head_dim=hf.get("head_dim") or E // H,
                   vocab_size=hf["vocab_size"], draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
                   target_hidden_size=hf.get("target_hidden_size") or E, rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
                   rope_theta=hf.get("rope_theta", 10000.0), rope_scaling=hf.get("rope_scaling"),
                   hidden_act=hf.get("hidden_act", "silu"), aux_layer_ids=tuple(ids) if ids else None,
                   norm_before_residual=bool(hf.get("norm_before_residual", False)))

    def aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input stream the head reads (vLLM's default for Llama models)."""
        ids = self.aux_layer_ids or (2, target_layers // 2, target_layers - 3)
        if len(ids) != 3 or not all(0 <= i < target_layers for i in ids):
            raise ValueError(f"EAGLE-3 aux layers {ids} do not fit a {target_layers}-layer target")
        return tuple(int(i) for i in ids)

    def attention_config(self) -> ModelConfig:
        """The head's attention dimensions as a one-layer ModelConfig (RoPE frequencies, pool shape)."""
        return ModelConfig(architecture="eagle3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)


def param_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    E, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return {"embed": (cfg.vocab_size, E), "fc": (3 * cfg.target_hidden_size, E),
            "input_norm": (E,), "hidden_norm": (E,), "post_attn_norm": (E,),
            "wq": (2 * E, cfg.num_heads * D), "wk": (2 * E, cfg.num_kv_heads * D), "wv": (2 * E, cfg.num_kv_heads * D),
            "wo": (cfg.num_heads * D, E), "w_gate": (E, F), "w_up": (E, F), "w_down": (F, E),
            "final_norm": (E,), "lm_head": (E, cfg.draft_vocab_size)}


# HF name -> (our name, transposed: HF linear weights are [out, in])
HF_NAMES = {
    "fc.weight": ("fc", True), "midlayer.input_layernorm.weight": ("input_norm", False),
    "midlayer.hidden_norm.weight": ("hidden_norm", False),
    "midlayer.post_attention_layernorm.weight": ("post_attn_norm", False),
    "midlayer.self_attn.q_proj.weight": ("wq", True), "midlayer.self_attn.k_proj.weight": ("wk", True),
    "midlayer.self_attn.v_proj.weight": ("wv", True), "midlayer.self_attn.o_proj.weight": ("wo", True),
    "midlayer.mlp.gate_proj.weight": ("w_gate", True), "midlayer.mlp.up_proj.weight": ("w_up", True),
    "midlayer.mlp.down_proj.weight": ("w_down", True), "norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True), "embed_tokens.weight": ("embed", False),
}


def load_eagle3(path: str | Path) -> tuple[Eagle3Config, dict[str, np.ndarray], np.ndarray]:
    """(config, weights by our names, d2t [draft vocab] int32) of a head checkpoint directory.
    `embed` is absent when the checkpoint shares the target's embedding."""
    from safetensors import safe_open

    from jaxserve.loading.safetensors_checkpoint import safetensors_files

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"EAGLE-3 head {str(path)!r} has no config.json")
    cfg = Eagle3Config.from_hf(json.loads((path / "config.json").read_text()))
    params: dict[str, np.ndarray] = {}
    d2t = None
    for f in safetensors_files(path):
        with safe_open(f, framework="flax") as st:
            for key in st.keys():
                name = key.removeprefix("model.")
                if name == "d2t":
                    d2t = np.asarray(st.get_tensor(key)).astype(np.int64)
                elif name == "t2d":
                    continue
                elif name in HF_NAMES:
                    ours, transpose = HF_NAMES[name]
                    value = np.asarray(st.get_tensor(key).astype(jnp.float32))
                    params[ours] = value.T if transpose else value
                else:
                    raise ValueError(f"EAGLE-3 head {str(path)!r}: unexpected tensor {key!r}")
    shapes = param_shapes(cfg)
    missing = sorted(set(shapes) - set(params) - {"embed"})
    if missing:
        raise ValueError(f"EAGLE-3 head {str(path)!r} is missing {missing}")
    for name, value in params.items():
        if value.shape != shapes[name]:
            raise ValueError(f"EAGLE-3 head {str(path)!r}: {name} is {value.shape}, the config needs {shapes[name]}")
    if d2t is None:  # no mapping: the draft vocabulary is the target's
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"EAGLE-3 head {str(path)!r} has a draft vocabulary of {cfg.draft_vocab_size} and no d2t")
        d2t = np.zeros(cfg.vocab_size, np.int64)
    if d2t.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"EAGLE-3 head {str(path)!r}: d2t is {d2t.shape}, expected ({cfg.draft_vocab_size},)")
    targets = np.arange(cfg.draft_vocab_size) + d2t
    if targets.min() < 0 or targets.max() >= cfg.vocab_size:
        raise ValueError(f"EAGLE-3 head {str(path)!r}: d2t maps draft ids outside the target vocabulary")
    return cfg, params, targets.astype(np.int32)


class Eagle3Head(nnx.Module):
    """The head's parameters (names as in `param_shapes`) and its forward pass."""

    def __init__(self, cfg: Eagle3Config, params: dict[str, jax.Array], draft_to_target: jax.Array,
                 dtype: Any = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        for name in param_shapes(cfg):
            setattr(self, name, nnx.Param(jnp.asarray(params[name], dtype)))
        self.draft_to_target = nnx.Variable(jnp.asarray(draft_to_target, jnp.int32))
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg.attention_config())))

    def combine(self, aux: jax.Array) -> jax.Array:
        """The target's three streams [T, 3 * E_target] -> the head's hidden input [T, E]."""
        return aux.astype(self.dtype) @ self.fc[...]

    def __call__(self, tokens: jax.Array, hidden: jax.Array, metadata: AttentionMetadata, kv_cache: jax.Array,
                 attention_fn: Callable[..., jax.Array], kv_write_fn: Callable[..., jax.Array] = write_kv,
                 ) -> tuple[jax.Array, jax.Array]:
        """tokens [T] (token p + 1 at position p), hidden [T, E]; kv_cache: the one layer's pool
        [num_pages, ...] (the target's per-layer page layout, without a layer axis: a reshape of the
        pool between its write and its reads made XLA copy it whole, 38 ms a 1-row step on CPU).
        Returns (prenorm [T, E], the new cache); `draft_ids` of the rows that draft."""
        cfg = self.cfg
        T = tokens.shape[0]
        H, KVH, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        pool = kv_cache
        e = rms_norm(self.embed[...][tokens].astype(self.dtype), self.input_norm[...], eps)
        h = rms_norm(hidden, self.hidden_norm[...], eps)
        residual = h if cfg.norm_before_residual else hidden
        x = jnp.concatenate([e, h], axis=-1)
        q = (x @ self.wq[...]).reshape(T, H, D)
        k = (x @ self.wk[...]).reshape(T, KVH, D)
        v = (x @ self.wv[...]).reshape(T, KVH, D)
        q = apply_rope(q, metadata.positions, self.inv_freq[...])
        k = apply_rope(k, metadata.positions, self.inv_freq[...])
        pool = kv_write_fn(pool, k, v, metadata.slot_mapping)
        attn = attention_fn(q, pool, metadata.kv_lens, metadata.page_tables, metadata.cu_q_lens, metadata.num_seqs,
                            k_new=k, v_new=v, sm_scale=D ** -0.5)
        x = attn.reshape(T, H * D).astype(self.dtype) @ self.wo[...] + residual
        m = rms_norm(x, self.post_attn_norm[...], eps)
        act = ACTIVATIONS[cfg.hidden_act]
        prenorm = (act(m @ self.w_gate[...]) * (m @ self.w_up[...])) @ self.w_down[...] + x
        return prenorm, pool

    def draft_ids(self, prenorm: jax.Array) -> jax.Array:
        """The greedy draft after each row of prenorm [N, E], as target token ids [N]."""
        logits = rms_norm(prenorm, self.final_norm[...], self.cfg.rms_norm_eps) @ self.lm_head[...]
        return self.draft_to_target[...][jnp.argmax(logits.astype(jnp.float32), axis=-1)]
