"""GGUF files (llama.cpp): metadata to ModelConfig, tensors dequantized with the `gguf` package,
or (``--quantization gguf``) the Q8_0 / Q4_0 / Q4_1 / Q4_K linear layers kept in their own quantization.

Families: Llama (SmolLM2), Mistral, Qwen2, Qwen3, the mixture-of-experts Qwen3-MoE (`qwen3moe`),
Qwen2-MoE (`qwen2moe`) and Mixtral (stored as `llama` with `llama.expert_count`), and Gemma 3 text
(`gemma3`). The file is read the way llama.cpp reads it: what its converter (convert_hf_to_gguf.py)
leaves out of the metadata is what llama.cpp hard-codes, and we assume the same values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from jaxserve.logs import progress
from jaxserve.loading.hf_names import StackedParams
from jaxserve.models.llama import ModelConfig
from jaxserve.models.registry import config_from_hf

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                      "gemma3": "Gemma3ForCausalLM"}
MIXTRAL = "MixtralForCausalLM"  # `llama` with experts: the converter files Mixtral under llama
# The converter interleaves the rotary halves of q/k rows only for the Llama class (Llama,
# Mistral, Mixtral); Qwen2/3, their MoE and Gemma 3 are written as HF has them.
PERMUTED_QK_ARCHS = ("llama", "mistral")
# GGUF tensor name (after "blk.N.") -> HF per-layer suffix.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # MoE: the router and Qwen2-MoE's shared expert with its sigmoid gate.
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 3's four norms: there `ffn_norm` is the MLP's input norm (HF pre_feedforward_layernorm).
GEMMA3_LAYER_NAMES = {**GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# Experts stacked per layer, [X, out, in] in numpy order -> our stacked names.
GGUF_EXPERT_STACKS = {"ffn_gate_exps": "we_gate", "ffn_up_exps": "we_up", "ffn_down_exps": "we_down"}
# Mixtral files written before experts were stacked: one tensor per expert, `ffn_gate.3`.
_PER_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)$")
_PER_EXPERT_HF = {"gate": "w1", "up": "w3", "down": "w2"}
# --quantization gguf: these tensors (our names) keep their file's quantization when every layer's
# type is one of NATIVE_TYPES with the same kernel format (jaxserve/quantization.py); others are
# dequantized as usual. Block layouts (ggml-common.h): Q8_0 = f16 d, 32 x int8 (w = d q);
# Q4_0 = f16 d, 16 bytes of nibbles (w = d (q - 8)); Q4_1 = f16 d, f16 m, 16 bytes (w = d q + m);
# Q4_K = 256 values: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
# 128 bytes of nibbles (w = d sc_j q - dmin m_j): a 4-bit group of ours per sub-block.
NATIVE_NAMES = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate",
                "ffn_up": "w_up", "ffn_down": "w_down", "token_embd": "embed", "output": "lm_head"}
NATIVE_TYPES = {GGMLQuantizationType.Q8_0: "int8", GGMLQuantizationType.Q4_0: "4-bit",
                GGMLQuantizationType.Q4_1: "4-bit", GGMLQuantizationType.Q4_K: "4-bit"}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                     "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# Gemma 3 constants llama.cpp hard-codes, as its converter does not write them: every 6th layer
# global and a query scale of head_dim ** -0.5, except for the 62-layer 27B model, where it is
# (hidden / heads) ** -0.5. The local RoPE base is 1e4 there too; current converters also write it
# (`rope.freq_base_swa`), older ones did not.
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return default
    if f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    if f.types[0] == GGUFValueType.ARRAY:
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types[0] == GGUFValueType.FLOAT32:
        # The shortest decimal that rounds to this float32 (1e-06, not 9.99999997e-07): the
        # value the HF config had, so that both loaders give equal configs.
        return float(str(f.parts[f.data[0]][0]))
    return f.parts[f.data[0]].tolist()[0]


def _dims(t: Any) -> list[int]:
    """A tensor's shape in numpy order (GGUF lists dims fastest-first)."""
    return [int(d) for d in reversed(t.shape)]


def gguf_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """A transformers-style config dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    layers = g("block_count")
    experts = g("expert_count", 0) or 0
    hf_arch = MIXTRAL if arch == "llama" and experts else GGUF_ARCHITECTURES[arch]
    # The embedding's rows are the vocabulary: llama.cpp's converter trims Gemma 3's unused rows,
    # and not every family writes `vocab_size`.
    embed = tensors.get("token_embd.weight")
    vocab = _dims(embed)[0] if embed is not None else (
        g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", [])))
    gemma = arch == "gemma3"
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("attention.key_length", hidden // heads),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-6 if gemma else 1e-5),
        "rope_theta": g("rope.freq_base", 1_000_000.0 if gemma else 10000.0),
        "max_position_embeddings": g("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = g("rope.scaling.type")
    if scaling not in (None, "none"):  # types our RoPE lacks (yarn) are refused by rope_inv_freq
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(g("rope.scaling.factor", 1.0))}
    if experts:
        cfg.update(_gguf_moe_fields(arch, g, tensors, experts))
    if gemma:
        cfg.update(_gguf_gemma3_fields(g, layers, hidden, heads, cfg["head_dim"]))
    return cfg


def _gguf_moe_fields(arch: str, g: Any, tensors: dict[str, Any], experts: int) -> dict[str, Any]:
    def width(name: str, key: str) -> int | None:
        """Metadata first, else the first layer's tensor ([X,] F, E in numpy order)."""
        if g(key):
            return int(g(key))
        t = tensors.get(f"blk.0.{name}.weight")
        return _dims(t)[-2] if t is not None else None

    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": g("expert_used_count"),
        # Mixtral's experts are `feed_forward_length` wide; Qwen-MoE writes its own key.
        "moe_intermediate_size": width("ffn_gate_exps", "expert_feed_forward_length") or g("feed_forward_length"),
        # llama.cpp renormalises the chosen k for Qwen3-MoE (and Mixtral) and not for Qwen2-MoE,
        # whatever the HF config said; `expert_weights_norm` overrides where a file has it.
        "norm_topk_prob": bool(g("expert_weights_norm", arch != "qwen2moe")),
    }
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = width("ffn_gate_shexp", "expert_shared_feed_forward_length") or 0
    return fields


def _gguf_gemma3_fields(g: Any, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    # A later llama.cpp honours a file without a window as all-global; we do the same.
    window = g("attention.sliding_window") or None
    pattern = g("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):  # per layer, true = sliding
        kinds = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        kinds = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    fields: dict[str, Any] = {
        "layer_types": kinds,
        "sliding_window": window,
        "rope_local_base_freq": float(g("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim,
        "final_logit_softcapping": g("final_logit_softcapping"),
        "attn_logit_softcapping": g("attn_logit_softcapping"),
    }
    return fields


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of q/k rows; undo it for HF-style RoPE."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dense_mlp_layers(reader: GGUFReader) -> list[int]:
    return sorted({int(t.name.split(".")[1]) for t in reader.tensors
                   if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.weight", t.name)})


def native_blocks(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A Q8_0 / Q4_0 / Q4_1 / Q4_K tensor [out, in] as (q, scales, offsets) in jaxserve/quantization.py's
    layout: the file's bytes regrouped; no weight is dequantized. Q8_0's, Q4_0's and Q4_1's scales
    and offsets stay float16, as the file stores them (a decode step reads them with the weights);
    Q4_K's are products of a float16 and a 6-bit integer, float32 to stay exact."""
    from jaxserve.quantization import GROUP

    out, n_in = _dims(t)
    blocks = np.asarray(t.data, np.uint8).reshape(out, n_in // GROUP, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if t.tensor_type == GGMLQuantizationType.Q8_0:
        return blocks[..., 2:].copy().view(np.int8).reshape(out, n_in), d, None
    if t.tensor_type == GGMLQuantizationType.Q4_0:  # values 0..15 with offset -8 d (exact in float16)
        return blocks[..., 2:].reshape(out, n_in // 2).copy(), d, (np.float32(-8.0) * d).astype(np.float16)
    if t.tensor_type == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        return blocks[..., 4:].reshape(out, n_in // 2).copy(), d, m
    if t.tensor_type == GGMLQuantizationType.Q4_K:
        return _q4_k_groups(np.asarray(t.data, np.uint8).reshape(out, n_in // 256, 144), out, n_in)
    raise ValueError(f"{t.name}: {t.tensor_type.name} is not served natively")


def _q4_k_groups(blocks: np.ndarray, out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [out, n_in / 256, 144 bytes] -> 4-bit groups of 32 (ggml's
    get_scale_min_k4 for the 6-bit scales and mins; the nibbles regrouped, not converted)."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    sc_bytes = blocks[..., 4:16]
    low, high = sc_bytes[..., 0:4], sc_bytes[..., 8:12]  # sub-blocks 0-3 in bytes 0-7, 4-7 spread over all 12
    scales = np.concatenate([low & 63, (high & 15) | ((low >> 6) << 4)], axis=-1).astype(np.float32)
    mins = np.concatenate([sc_bytes[..., 4:8] & 63, (high >> 4) | ((sc_bytes[..., 4:8] >> 6) << 4)],
                          axis=-1).astype(np.float32)
    # Nibbles: 4 chunks of 32 bytes; chunk c's low nibbles are sub-block 2c, its high ones 2c + 1.
    qs = blocks[..., 16:].reshape(out, n_in // 256, 4, 32)
    values = np.stack([qs & 15, qs >> 4], axis=3).reshape(out, n_in)
    from jaxserve.quantization import pack_q4

    return pack_q4(values), (d * scales).reshape(out, -1), (-(dmin * mins)).reshape(out, -1)


def _our_native_name(tensor_name: str) -> tuple[str, int] | None:
    """GGUF tensor name -> (our parameter, layer or -1) for the weights NATIVE_NAMES lists."""
    parts = tensor_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[3] == "weight" and parts[2] in NATIVE_NAMES:
        return NATIVE_NAMES[parts[2]], int(parts[1])
    if len(parts) == 2 and parts[1] == "weight" and parts[0] in ("token_embd", "output"):
        return NATIVE_NAMES[parts[0]], -1
    return None


def _native_params(reader: GGUFReader) -> dict[str, str]:
    """Our parameter -> kernel format, for those whose every tensor has a type served natively,
    all in one format (a stacked parameter holds one format)."""
    kinds: dict[str, set[str | None]] = {}
    for t in reader.tensors:
        if (found := _our_native_name(t.name)) is not None:
            kinds.setdefault(found[0], set()).add(NATIVE_TYPES.get(t.tensor_type))
    return {name: next(iter(k)) for name, k in kinds.items() if len(k) == 1 and None not in k}


def load_gguf(path: Path, dtype: np.dtype, native: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and stacked weights (in `dtype`) of a GGUF file, with llama.cpp's edits undone.
    native: the linear layers and the embedding stored as Q8_0 / Q4_0 / Q4_1 / Q4_K stay in that
    quantization (jaxserve/quantization.py's layout, under name, name_scale, name_offset)."""
    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    hf = gguf_hf_config(reader)
    cfg = config_from_hf(hf)
    if cfg.is_moe and (dense := _dense_mlp_layers(reader)):
        # One MLP kind for every layer under the stacked scan, as for safetensors (registry._moe_fields).
        raise ValueError(f"{path.name}: layers {dense} have a dense MLP; only all-sparse MoE files are supported")
    permute_qk = arch in PERMUTED_QK_ARCHS
    layer_names = GEMMA3_LAYER_NAMES if arch == "gemma3" else GGUF_LAYER_NAMES
    # llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w; our norms add the 1 themselves
    # (norm_offset), as HF does, so the config matches the HF directory's and bf16 keeps w's precision.
    norm_shift = 1.0 if arch == "gemma3" else 0.0
    stacked = StackedParams(cfg, dtype)
    native_names: dict[str, str] = {}
    if native:
        if cfg.is_moe:
            raise ValueError("--quantization gguf does not support mixture-of-experts models yet; "
                             "serve it without --quantization (dequantized)")
        native_names = _native_params(reader)
        stacked.exclude(set(native_names))
    kept: dict[str, list[Any]] = {}  # our name -> per-layer (q, s, m), or one entry for a global
    for t in progress(reader.tensors, "dequantizing GGUF", unit="tensor"):  # a bar only on a terminal
        found = _our_native_name(t.name)
        if found is not None and found[0] in native_names:
            name, layer = found
            q, scale, offset = native_blocks(t)
            if permute_qk and name in ("wq", "wk"):
                heads = cfg.num_heads if name == "wq" else cfg.num_kv_heads
                q, scale = _unpermute_rope(q, heads), _unpermute_rope(scale, heads)
                offset = None if offset is None else _unpermute_rope(offset, heads)
            slots = kept.setdefault(name, [None] * (cfg.num_layers if layer >= 0 else 1))
            slots[max(layer, 0)] = (q, scale, offset)
            continue
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            base, _, kind = rest.rpartition(".")
            if base in GGUF_EXPERT_STACKS:
                stacked.add_expert_stack(int(layer), GGUF_EXPERT_STACKS[base], _dequantize(t), t.name)
                continue
            if m := _PER_EXPERT_RE.match(base):
                hf_name = f"model.layers.{layer}.block_sparse_moe.experts.{m[2]}.{_PER_EXPERT_HF[m[1]]}.{kind}"
            elif base in layer_names:
                hf_name = f"model.layers.{layer}.{layer_names[base]}.{kind}"
            else:
                continue
        elif t.name in GGUF_GLOBAL_NAMES:
            hf_name, base = GGUF_GLOBAL_NAMES[t.name], t.name.rpartition(".")[0]
        else:
            continue
        value = _dequantize(t)
        if permute_qk and base in ("attn_q", "attn_k"):
            heads = cfg.num_heads if base == "attn_q" else cfg.num_kv_heads
            value = _unpermute_rope(value, heads)
        if norm_shift and base.endswith("norm"):
            value = value - np.float32(norm_shift)  # float32, before any cast to the serving dtype
        stacked.add(hf_name, value)
    params = stacked.finish()
    for name, slots in kept.items():
        if any(slot is None for slot in slots):
            raise ValueError(f"{path.name}: {name} is missing in layers {[i for i, x in enumerate(slots) if x is None]}")
        if name == "lm_head" and cfg.tie_word_embeddings:
            continue
        stack = (lambda i: np.stack([slot[i] for slot in slots])) if name not in ("embed", "lm_head") else (
            lambda i: slots[0][i])
        params[name], params[name + "_scale"] = stack(0), stack(1)
        if slots[0][2] is not None:
            params[name + "_offset"] = stack(2)
    return cfg, params


def _dequantize(t: Any) -> np.ndarray:
    """Float32 in numpy order, HF's [out, in] (experts [X, out, in])."""
    return dequantize(t.data, t.tensor_type).reshape(_dims(t))
