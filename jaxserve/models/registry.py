"""Which checkpoint architectures map onto our one Llama-family decoder, and how their configs read.

A mixture-of-experts family is a feature set here plus its names in ``loading.hf_names``: the
decoder is shared, only the MLP differs (``models.moe``)."""

from __future__ import annotations

import logging
from typing import Any

from jaxserve.models.llama import ModelConfig

log = logging.getLogger(__name__)

# HF `architectures` entry -> features beyond plain Llama.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    # Mixtral: top-k over the logits, softmax over the chosen (always normalised); expert FFN
    # width is `intermediate_size`; Mistral's sliding window.
    "MixtralForCausalLM": {"moe": True, "router": "topk_softmax", "norm_topk_prob": True},
    # Qwen-MoE: softmax over all experts, then top-k, renormalised when `norm_topk_prob`.
    "Qwen3MoeForCausalLM": {"moe": True, "qk_norm": True},
    "Qwen2MoeForCausalLM": {"moe": True, "attention_bias": True, "shared_expert": True},
    # Gemma 3 (text): local/global layers, (1 + w) norms around attention and MLP, GELU, scaled embeddings.
    "Gemma3ForCausalLM": {"gemma3": True, "qk_norm": True},
}
SLIDING_BY_DEFAULT = ("MistralForCausalLM", "MixtralForCausalLM")


def check_architecture(arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a transformers ``config.json`` dict."""
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    arch = archs[0]
    check_architecture(arch)
    features = SUPPORTED_ARCHITECTURES[arch]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    attention_bias = features.get("attention_bias", False) or bool(hf.get("attention_bias", False))
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", arch in SLIDING_BY_DEFAULT) else None
    rope_scaling = hf.get("rope_scaling")
    rope_theta = hf.get("rope_theta")
    # transformers 5 moved rope settings into `rope_parameters`.
    params = hf.get("rope_parameters") or {}
    if rope_theta is None:
        rope_theta = params.get("rope_theta", 10000.0)
    if rope_scaling is None and params.get("rope_type", "default") != "default":
        rope_scaling = params
    moe = _moe_fields(hf, arch, features) if features.get("moe") else {}
    gemma = _gemma3_fields(hf, arch) if features.get("gemma3") else {}
    if gemma:
        sliding = gemma.pop("sliding_window")
        rope_theta, rope_scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
    return ModelConfig(
        **moe,
        **gemma,
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", features.get("gemma3", False))),  # Gemma: tied unless said
        attention_bias=attention_bias,
        qk_norm=features.get("qk_norm", False),
        sliding_window=sliding,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
    )


def _moe_fields(hf: dict[str, Any], arch: str, features: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`; the hub's configs say `num_experts`.
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not experts:
        raise ValueError(f"{arch} config.json has no num_experts / num_local_experts")
    # Qwen-MoE can interleave dense layers (mlp_only_layers, decoder_sparse_step); the stacked
    # layer scan needs one MLP kind for every layer, and the released checkpoints are all sparse.
    layers = hf["num_hidden_layers"]
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = sorted(set(hf.get("mlp_only_layers") or []) | {l for l in range(layers) if (l + 1) % step})
    if dense:
        raise ValueError(f"{arch}: layers {dense} are dense (mlp_only_layers / decoder_sparse_step={step}); "
                         f"only all-sparse MoE checkpoints are supported")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        router=features.get("router", "softmax_topk"),
        norm_topk_prob=bool(features.get("norm_topk_prob", hf.get("norm_topk_prob", False))),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
        if features.get("shared_expert") else 0,
    )


def _rope_pair(params: dict[str, Any] | None, theta: float | None,
               scaling: dict[str, Any] | None) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one layer kind from a transformers 5 `rope_parameters` entry, or from the
    older separate keys."""
    if params:
        theta = params.get("rope_theta", theta)
        scaling = params if params.get("rope_type", "default") != "default" else None
    return float(theta), scaling


def _gemma3_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{arch}: use_bidirectional_attention (an embedding model) is not supported")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{arch}: hidden_activation {hf.get('hidden_activation')!r} is not supported")
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if not kinds:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = hf.get("sliding_window_pattern") or 6
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown or len(kinds) != layers:
        raise ValueError(f"{arch}: layer_types must name {layers} sliding_attention/full_attention layers")
    # transformers 5: rope_parameters keyed by layer type; older: rope_theta, rope_local_base_freq,
    # rope_scaling (global layers only).
    rope = hf.get("rope_parameters") or {}
    keyed = "full_attention" in rope or "sliding_attention" in rope
    theta, scaling = _rope_pair(rope.get("full_attention") if keyed else None,
                                hf.get("rope_theta", 1_000_000.0), hf.get("rope_scaling"))
    local_theta, local_scaling = _rope_pair(rope.get("sliding_attention") if keyed else None,
                                            hf.get("rope_local_base_freq", 10_000.0), None)
    window = hf.get("sliding_window", 4096)
    sliding = tuple(int(k == "sliding_attention") for k in kinds)
    if window is None:
        sliding = tuple(0 for _ in kinds)
    softcap = lambda k: None if hf.get(k) is None else float(hf[k])  # noqa: E731
    if hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma3Attention never passes it to attention (Gemma 2's does); the released
        # Gemma 3 configs leave it null. We match transformers, the reference.
        log.warning("%s: attn_logit_softcapping=%s is ignored, as transformers ignores it for Gemma 3",
                    arch, hf["attn_logit_softcapping"])
    return dict(
        sliding_window=window, rope_theta=theta, rope_scaling=scaling,
        sliding_layers=sliding, rope_local_theta=local_theta, rope_local_scaling=local_scaling,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),  # Gemma3TextConfig's defaults
        final_logit_softcap=softcap("final_logit_softcapping"),
        norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=True,
    )
