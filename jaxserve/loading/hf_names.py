"""Mapping from HF transformers parameter names to our stacked parameter names."""

from __future__ import annotations

import re

import numpy as np

from jaxserve.models.llama import ModelConfig, param_shapes

# HF per-layer suffix -> (our name, transpose?). HF linear weights are [out, in]; ours [in, out].
LAYER_NAMES: dict[str, tuple[str, bool]] = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    # MoE routers [X, E] (Qwen-MoE: mlp.gate; Mixtral: block_sparse_moe.gate) and Qwen2-MoE's shared expert.
    "mlp.gate.weight": ("router", True),
    "block_sparse_moe.gate.weight": ("router", True),
    "mlp.shared_expert.gate_proj.weight": ("ws_gate", True),
    "mlp.shared_expert.up_proj.weight": ("ws_up", True),
    "mlp.shared_expert.down_proj.weight": ("ws_down", True),
    "mlp.shared_expert_gate.weight": ("shared_gate", False),  # [1, E], reshaped to [E]
}
# Gemma's four norms per layer: post_attention_layernorm is on the attention output there, and the
# MLP's input norm is pre_feedforward_layernorm.
SANDWICH_NORM_NAMES: dict[str, tuple[str, bool]] = {
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}
# Per-expert suffix (after `...experts.N.`) -> our stacked [L, X, ...] name; all are transposed.
EXPERT_NAMES: dict[str, str] = {
    "gate_proj.weight": "we_gate", "up_proj.weight": "we_up", "down_proj.weight": "we_down",  # Qwen-MoE
    "w1.weight": "we_gate", "w3.weight": "we_up", "w2.weight": "we_down",  # Mixtral
}
_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(.+)$")
# transformers 5 in memory (and checkpoints saved without its reverse mapping) fuse the experts:
# gate_up_proj [X, 2F, E] (gate rows first), down_proj [X, E, F].
_FUSED_EXPERTS = {"mlp.experts.gate_up_proj": "gate_up", "mlp.experts.down_proj": "down"}
GLOBAL_NAMES: dict[str, tuple[str, bool]] = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class StackedParams:
    """Collects HF tensors one by one into preallocated stacked float32 arrays."""

    def __init__(self, cfg: ModelConfig, dtype: np.dtype = np.float32):
        self.cfg = cfg
        self.shapes = param_shapes(cfg)
        # Allocated in the serving dtype so a bf16 model never holds a float32 copy of itself.
        self.arrays = {n: np.empty(s, dtype) for n, s in self.shapes.items()}
        self.seen: set[tuple[str, int]] = set()
        self.seen_experts: set[tuple[str, int, int]] = set()
        self.layer_names = {**LAYER_NAMES, **SANDWICH_NORM_NAMES} if cfg.sandwich_norms else LAYER_NAMES

    def exclude(self, names: set[str]) -> None:
        """Parameters the caller collects itself (GGUF weights kept quantized): not allocated,
        not expected by finish()."""
        for name in names:
            self.shapes.pop(name, None)
            self.arrays.pop(name, None)

    def _put(self, name: str, index: tuple[int, ...], value: np.ndarray, hf_name: str) -> None:
        if name not in self.shapes:
            raise ValueError(f"checkpoint tensor {hf_name!r} does not fit config {self.cfg.architecture}")
        target = self.arrays[name][index]
        if value.shape != target.shape:
            raise ValueError(f"tensor {hf_name!r} has shape {value.shape}, expected {target.shape}")
        target[...] = value

    def _add_experts(self, layer: int, suffix: str, value: np.ndarray, hf_name: str) -> bool:
        """Expert tensors, one per expert or fused over experts. False: not an expert tensor."""
        m = _EXPERT_RE.match(suffix)
        if m and m.group(2) in EXPERT_NAMES:
            expert, name = int(m.group(1)), EXPERT_NAMES[m.group(2)]
            if expert >= self.cfg.num_experts:
                raise ValueError(f"checkpoint tensor {hf_name!r}: the config has {self.cfg.num_experts} experts")
            self._put(name, (layer, expert), value.T, hf_name)
            self.seen_experts.add((name, layer, expert))
            return True
        if suffix in _FUSED_EXPERTS:
            if _FUSED_EXPERTS[suffix] == "gate_up":
                F = value.shape[1] // 2
                parts = {"we_gate": value[:, :F], "we_up": value[:, F:]}
            else:
                parts = {"we_down": value}
            for name, part in parts.items():
                self.add_expert_stack(layer, name, part, hf_name)
            return True
        return False

    def add_expert_stack(self, layer: int, name: str, value: np.ndarray, source: str) -> None:
        """All of one layer's experts of one projection at once: value [X, out, in] (each expert's
        [out, in] stacked on a leading axis, as transformers 5 fuses them and GGUF stores them) into
        our [X, in, out] slot, one strided copy with no per-expert split. name: we_gate, we_up, we_down."""
        if name not in EXPERT_NAMES.values():
            raise ValueError(f"{source!r}: {name!r} is not an expert weight")
        if layer >= self.cfg.num_layers:
            raise ValueError(f"{source!r}: layer {layer} is past the config's {self.cfg.num_layers} layers")
        self._put(name, (layer,), np.swapaxes(value, 1, 2), source)
        self.seen_experts.update((name, layer, e) for e in range(self.cfg.num_experts))

    def add(self, hf_name: str, tensor: np.ndarray) -> None:
        m = _LAYER_RE.match(hf_name)
        if m:
            layer, suffix = int(m.group(1)), m.group(2)
            if layer < self.cfg.num_layers and self._add_experts(layer, suffix, np.asarray(tensor), hf_name):
                return
            if suffix not in self.layer_names or layer >= self.cfg.num_layers:
                return  # e.g. rotary_emb.inv_freq buffers: recomputed, not loaded
            name, transpose = self.layer_names[suffix]
        elif hf_name in GLOBAL_NAMES:
            name, transpose = GLOBAL_NAMES[hf_name]
            layer = -1
        else:
            return
        if name not in self.shapes:
            if name == "lm_head":  # tied checkpoints that still store the head
                return
            raise ValueError(f"checkpoint tensor {hf_name!r} does not fit config {self.cfg.architecture}")
        value = np.asarray(tensor)
        if transpose:
            value = value.T
        if name == "shared_gate":
            value = value.reshape(-1)
        target = self.arrays[name] if layer < 0 else self.arrays[name][layer]
        if value.shape != target.shape:
            raise ValueError(f"tensor {hf_name!r} has shape {value.shape}, expected {target.shape}")
        target[...] = value
        self.seen.add((name, layer))

    def finish(self) -> dict[str, np.ndarray]:
        missing = []
        expert_names = set(EXPERT_NAMES.values())
        for name, shape in self.shapes.items():
            if name in expert_names:
                missing += [f"{name}[{l}][{e}]" for l in range(self.cfg.num_layers)
                            for e in range(self.cfg.num_experts) if (name, l, e) not in self.seen_experts]
            elif len(shape) >= 1 and name in {n for n, _ in self.layer_names.values()}:
                missing += [f"{name}[{l}]" for l in range(self.cfg.num_layers) if (name, l) not in self.seen]
            elif (name, -1) not in self.seen:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return self.arrays
