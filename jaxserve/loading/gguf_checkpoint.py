"""GGUF files (llama.cpp): metadata to ModelConfig, tensors dequantized with the `gguf` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from jaxserve.logs import progress
from jaxserve.loading.hf_names import StackedParams
from jaxserve.models.llama import ModelConfig
from jaxserve.models.registry import config_from_hf

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# GGUF tensor name (after "blk.N.") -> HF per-layer suffix.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                     "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return default
    if f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    if f.types[0] == GGUFValueType.ARRAY:
        return [f.parts[i].tolist()[0] for i in f.data]
    return f.parts[f.data[0]].tolist()[0]


def gguf_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """A transformers-style config dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", [])),
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("attention.key_length", hidden // heads),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g("rope.freq_base", 10000.0),
        "max_position_embeddings": g("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "llama" and g("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
    return cfg


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of q/k rows; undo it for HF-style RoPE."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, dtype: np.dtype) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    reader = GGUFReader(str(path))
    hf = gguf_hf_config(reader)
    cfg = config_from_hf(hf)
    permute_qk = hf["architectures"][0] in ("LlamaForCausalLM", "MistralForCausalLM")
    stacked = StackedParams(cfg, dtype)
    for t in progress(reader.tensors, "dequantizing GGUF", unit="tensor"):  # a bar only on a terminal
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            base, _, kind = rest.rpartition(".")
            if base not in GGUF_LAYER_NAMES:
                continue
            hf_name = f"model.layers.{layer}.{GGUF_LAYER_NAMES[base]}.{kind}"
        elif t.name in GGUF_GLOBAL_NAMES:
            hf_name, base = GGUF_GLOBAL_NAMES[t.name], None
        else:
            continue
        # GGUF lists dims fastest-first; dequantize gives numpy order, i.e. HF's [out, in].
        value = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if permute_qk and base in ("attn_q", "attn_k"):
            heads = cfg.num_heads if base == "attn_q" else cfg.num_kv_heads
            value = _unpermute_rope(value, heads)
        stacked.add(hf_name, value)
    return cfg, stacked.finish()
