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
}
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

    def add(self, hf_name: str, tensor: np.ndarray) -> None:
        m = _LAYER_RE.match(hf_name)
        if m:
            layer, suffix = int(m.group(1)), m.group(2)
            if suffix not in LAYER_NAMES or layer >= self.cfg.num_layers:
                return  # e.g. rotary_emb.inv_freq buffers: recomputed, not loaded
            name, transpose = LAYER_NAMES[suffix]
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
        target = self.arrays[name] if layer < 0 else self.arrays[name][layer]
        if value.shape != target.shape:
            raise ValueError(f"tensor {hf_name!r} has shape {value.shape}, expected {target.shape}")
        target[...] = value
        self.seen.add((name, layer))

    def finish(self) -> dict[str, np.ndarray]:
        missing = []
        for name, shape in self.shapes.items():
            if len(shape) >= 1 and name in {n for n, _ in LAYER_NAMES.values()}:
                missing += [f"{name}[{l}]" for l in range(self.cfg.num_layers) if (name, l) not in self.seen]
            elif (name, -1) not in self.seen:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return self.arrays
