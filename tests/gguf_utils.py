"""Test helper: a GGUF file from a tiny HF checkpoint, written as llama.cpp's convert_hf_to_gguf.py
writes one, so that the loader is tested against the converter's conventions rather than its own:

- tensor names through the `gguf` package's own TensorNameMap for the architecture;
- the metadata keys the converter writes (and none of those it leaves to llama.cpp's hard-coding);
- its tensor edits: q/k rows interleaved for the Llama class (Llama, Mistral, Mixtral), Gemma 3's
  RMSNorm weights stored as 1 + w, the experts of a layer stacked into one [X, out, in] tensor;
- a tokenizer in the file's metadata: byte-level BPE over the tiny models' 256 ids.

`quant="Q8_0"` (or "Q4_0", "Q4_1") quantizes what llama.cpp would (matrices whose rows are whole
32-value blocks, not the MoE routers), and returns the weights as they come back from that
quantization, keyed by HF name, so that a test can build the HF reference from the very values
the file holds.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np

# HF architecture -> GGUF architecture, as the converter registers them.
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
             "Qwen2MoeForCausalLM": "qwen2moe", "Gemma3ForCausalLM": "gemma3"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# Per-expert HF projection -> the merged name the converter maps (through TensorNameMap).
_MERGED = {"w1": "layers.{l}.feed_forward.experts.w1", "w2": "layers.{l}.feed_forward.experts.w2",
           "w3": "layers.{l}.feed_forward.experts.w3", "gate_proj": "model.layers.{l}.mlp.experts.gate_proj",
           "up_proj": "model.layers.{l}.mlp.experts.up_proj", "down_proj": "model.layers.{l}.mlp.experts.down_proj"}
Q8_BLOCK = 32


def _hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rope_theta(hp: dict, kind: str = "full_attention") -> float:
    params = hp.get("rope_parameters") or {}
    params = params.get(kind, params)
    return float(hp.get("rope_theta") or params.get("rope_theta", 10000.0))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's LlamaModel.permute: rotary halves of each head's rows interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantizable(gguf_name: str, w: np.ndarray, quant: str) -> bool:
    # llama.cpp's quantizer keeps 1-D tensors and the MoE routers (ffn_gate_inp*) in float.
    return (quant != "F32" and w.ndim >= 2 and w.shape[-1] % Q8_BLOCK == 0
            and "ffn_gate_inp" not in gguf_name)


def write_gguf(hf_dir: Path, out: Path, quant: str = "F32", stack_experts: bool = True) -> dict[str, np.ndarray]:
    """Write `out` from `hf_dir`. Returns the HF tensors as the file holds them (after a Q8_0 round
    trip where quantized). stack_experts=False writes Mixtral's experts one tensor each, as
    converters did before stacking (`blk.N.ffn_gate.E.weight`)."""
    hp = json.loads((hf_dir / "config.json").read_text())
    hf_arch = hp["architectures"][0]
    arch = GGUF_ARCH[hf_arch]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    L, heads = hp["num_hidden_layers"], hp["num_attention_heads"]
    kv_heads = hp.get("num_key_value_heads") or heads
    names = gguf.get_tensor_name_map(model_arch, L)
    w = gguf.GGUFWriter(str(out), arch)

    # Metadata, key by key as the converter's set_gguf_parameters writes it for these families.
    w.add_block_count(L)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(_rope_theta(hp))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    experts = hp.get("num_local_experts") or hp.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // heads)
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if hp.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    if arch == "gemma3":
        full = (hp.get("rope_parameters") or {}).get("full_attention") or hp.get("rope_scaling") or {}
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        # Current converters write the local base (TextModel, from rope_parameters); older ones did not.
        if "sliding_attention" in (hp.get("rope_parameters") or {}):
            w.add_rope_freq_base_swa(_rope_theta(hp, "sliding_attention"))
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quant == "F32" else getattr(gguf.LlamaFileType, f"MOSTLY_{quant}"))
    _write_tokenizer(w, hp)

    tensors = _hf_tensors(hf_dir)
    held: dict[str, np.ndarray] = {}  # HF name -> the values the file holds, in HF's layout
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    planned: list[tuple[str, np.ndarray]] = []
    for name, t in tensors.items():
        value = np.asarray(t, np.float32)
        m = _EXPERT.match(name)
        if m and stack_experts:
            new = names.get_name(_MERGED[m[3]].format(l=m[1]) + ".weight", try_suffixes=(".weight",))
            stacks.setdefault((int(m[1]), new), {})[int(m[2])] = value
        elif m:  # the pre-stacking layout: blk.N.ffn_{gate,up,down}.E.weight
            new = f"blk.{m[1]}.ffn_{ {'w1': 'gate', 'w3': 'up', 'w2': 'down'}[m[3]] }.{m[2]}.weight"
            planned.append((new, value))
        else:
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ValueError(f"no GGUF name for {name}")
            edited = value
            if arch == "llama" and re.search(r"\.(q|k)_proj\.(weight|bias)$", name):
                edited = _permute(value, heads if ".q_proj." in name else kv_heads)
            if arch == "gemma3" and name.endswith("norm.weight"):
                edited = value + np.float32(1.0)
            planned.append((new, edited))
        # Q8_0 blocks run along rows; permuting or stacking rows keeps each block whole, so the
        # round trip of the HF tensor is what the file holds.
        held[name] = _roundtrip(value, quant) if _quantizable(new, value, quant) else value
    for (layer, new), per in sorted(stacks.items()):
        planned.append((new, np.stack([per[e] for e in range(len(per))])))
    for new, value in planned:
        if _quantizable(new, value, quant):
            w.add_tensor(new, gguf.quants.quantize(value, gguf.GGMLQuantizationType[quant]),
                         raw_dtype=gguf.GGMLQuantizationType[quant])
        else:
            w.add_tensor(new, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _roundtrip(t: np.ndarray, quant: str) -> np.ndarray:
    q = gguf.GGMLQuantizationType[quant]
    return gguf.quants.dequantize(gguf.quants.quantize(t, q), q).reshape(t.shape)


def _write_tokenizer(w: gguf.GGUFWriter, hp: dict) -> None:
    """A byte-level BPE tokenizer (`gpt2`, what jaxserve rebuilds without torch) of exactly the
    model's vocabulary: the 256 byte symbols, no merges, so any text encodes. Small on purpose:
    a real 49k-token vocabulary costs seconds in every GGUFReader parse."""
    from tokenizers import pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    if len(symbols) != hp["vocab_size"]:
        raise ValueError(f"the byte-level tokenizer has {len(symbols)} tokens, the model {hp['vocab_size']}")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(symbols)
    w.add_token_types([gguf.TokenType.NORMAL] * len(symbols))
    w.add_bos_token_id(hp["bos_token_id"])
    w.add_eos_token_id(hp["eos_token_id"])


def hf_dir_with(hf_dir: Path, tensors: dict[str, np.ndarray], out: Path) -> Path:
    """A copy of `hf_dir` (config, tokenizer) whose weights are `tensors`: the HF reference for a
    quantized file, built from the values the file holds."""
    from safetensors.numpy import save_file

    shutil.copytree(hf_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
