"""Which checkpoint architectures map onto our one Llama-family decoder, and how their configs read."""

from __future__ import annotations

from typing import Any

from jaxserve.models.llama import ModelConfig

# HF `architectures` entry -> features beyond plain Llama.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


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
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "MistralForCausalLM") else None
    rope_scaling = hf.get("rope_scaling")
    rope_theta = hf.get("rope_theta")
    # transformers 5 moved rope settings into `rope_parameters`.
    params = hf.get("rope_parameters") or {}
    if rope_theta is None:
        rope_theta = params.get("rope_theta", 10000.0)
    if rope_scaling is None and params.get("rope_type", "default") != "default":
        rope_scaling = params
    return ModelConfig(
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
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=features.get("qk_norm", False),
        sliding_window=sliding,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
    )
