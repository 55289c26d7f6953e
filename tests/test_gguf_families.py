"""GGUF files of the mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE) and Gemma 3, written
from tiny HF checkpoints the way llama.cpp's converter writes them (tests/gguf_utils.py), loaded
through jaxserve's normal path and checked against HF transformers and the safetensors loader."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import hf_logits, make_tiny_checkpoint, small_engine_options
from gguf_utils import hf_dir_with, write_gguf
from model_utils import prefill_logits
from test_moe import TINY_MOE

from jaxserve import SamplingParams
from jaxserve.loading import load_weights
from jaxserve.models.llama import LlamaForCausalLM

REL_TOL = 1e-4
# Q8_0 is checked two ways. Logits: against HF given the very values the file holds (each
# quantized tensor's Q8_0 round trip), at REL_TOL like F32: that tests the loader. Against the
# unquantized model the logits say little here: the tiny random models (weights ~N(0, 0.2)) amplify
# any perturbation, and a flipped top-k routing is a jump, so Q8_0 moved the largest logit by 5.7e-2
# (Gemma 3) and 3.8e-1 (Qwen3-MoE, 40 tokens) in one run. Weights: each within Q8_0's own bound of
# the original. A block of 32 is stored as round(w / d) * f16(d), d = max|w_block| / 127, so a
# weight moves by at most d/2 + 127 * d * 2**-11 (the f16 rounding of d) < 0.57 d.
Q8_0_STEP_FRACTION = 0.57
# The converter writes neither Gemma 3's layer pattern, its local RoPE base nor its query scale;
# llama.cpp hard-codes every 6th layer global, 1e4 and head_dim. conftest's gemma3 (pattern 3,
# scalar 48) could not be told apart in a GGUF, so this one follows llama.cpp's constants, with
# linear RoPE scaling on the global layer (which the converter does write) and soft-capping.
GEMMA3_GGUF = ("Gemma3TextConfig", dict(
    num_attention_heads=4, num_key_value_heads=2, head_dim=256, num_hidden_layers=6, sliding_window=16,
    sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    rope_scaling=dict(rope_type="linear", factor=4.0), query_pre_attn_scalar=256, final_logit_softcapping=3.0))
FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "gemma3"]
# (family, quantization): every family in F32, two in Q8_0 (dims that are whole 32-value blocks).
CASES = [(f, "F32") for f in FAMILIES] + [("qwen3_moe", "Q8_0"), ("gemma3", "Q8_0")]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_hf")
    dirs = {f: make_tiny_checkpoint(f, root, TINY_MOE[f][:2], **TINY_MOE[f][2]) for f in FAMILIES if f in TINY_MOE}
    dirs["gemma3"] = make_tiny_checkpoint("gemma3", root, GEMMA3_GGUF)
    return dirs


@pytest.fixture(scope="module")
def gguf_files(hf_dirs, tmp_path_factory):
    """(family, quant) -> (the .gguf path, the HF directory holding the same values)."""
    root = tmp_path_factory.mktemp("gguf_files")
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, quant: str) -> tuple[Path, Path]:
        if (family, quant) not in made:
            path = root / f"{family}-{quant}.gguf"
            held = write_gguf(hf_dirs[family], path, quant)
            ref = hf_dirs[family] if quant == "F32" else hf_dir_with(hf_dirs[family], held, root / f"{family}-{quant}-hf")
            made[family, quant] = (path, ref)
        return made[family, quant]

    return get


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def our_model(path: Path) -> LlamaForCausalLM:
    cfg, params = load_weights(path, "float32", use_cache=False)
    model = LlamaForCausalLM(cfg)
    model.load_params(params)
    return model


def _rope(scaling: dict | None) -> tuple | None:
    return None if scaling is None else (scaling.get("rope_type"), scaling.get("factor"))


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_config_equals_the_hf_directory(family, hf_dirs, gguf_files):
    """Metadata (plus llama.cpp's hard-coded constants) give the config the HF directory gives."""
    from jaxserve.loading.safetensors_checkpoint import read_config

    path, _ = gguf_files(family, "F32")
    ours, _ = load_weights(path, "float32", use_cache=False)
    ref = read_config(hf_dirs[family])
    assert _rope(ours.rope_scaling) == _rope(ref.rope_scaling)
    skip = {"rope_scaling": None}  # transformers 5 adds rope_theta to the scaling dict; compared above
    assert dataclasses.replace(ours, **skip) == dataclasses.replace(ref, **skip)
    if family == "gemma3":
        assert ours.sliding_layers == (1, 1, 1, 1, 1, 0) and ours.query_pre_attn_scalar == 256
        assert (ours.rope_theta, ours.rope_local_theta, ours.final_logit_softcap) == (1e6, 1e4, 3.0)


@pytest.mark.parametrize("family,quant", CASES)
def test_gguf_logits_match_hf(family, quant, hf_dirs, gguf_files):
    import transformers

    path, ref_dir = gguf_files(family, quant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir).eval()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (1, 7, 17, 40)]  # 40: past Gemma's 16-token window
    ours = prefill_logits(our_model(path), prompts)
    errs = [rel_err(o, hf_logits(hf, p)) for o, p in zip(ours, prompts)]
    # F32: the checkpoint's own values. Q8_0: HF given the values the file holds.
    assert max(errs) <= REL_TOL, errs


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3"])
def test_q8_0_weights_within_the_quantization_bound(family, gguf_files):
    q8, _ = gguf_files(family, "Q8_0")
    f32, _ = gguf_files(family, "F32")
    _, ours = load_weights(q8, "float32", use_cache=False)
    _, ref = load_weights(f32, "float32", use_cache=False)
    quantized = 0
    for name, w in ref.items():
        # The bound with the tensor's largest block (per-block scales are at most that).
        bound = Q8_0_STEP_FRACTION * np.abs(w).max() / 127
        err = np.abs(ours[name] - w).max()
        assert err <= bound, (name, err, bound)
        quantized += bool(err > 1e-6)
    assert quantized >= 5  # the matrices were quantized; norms and routers stay float


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_greedy_matches_safetensors(family, hf_dirs, gguf_files):
    """The same model from the .gguf and from its safetensors directory, through the engine
    (the converted-weights cache, the GGUF tokenizer) gives the same greedy tokens."""
    from jaxserve import LLM

    path, _ = gguf_files(family, "F32")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 20, 40)]  # 40: past Gemma's window
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, model in (("gguf", path), ("safetensors", hf_dirs[family])):
        llm = LLM(model=str(model), **small_engine_options())
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["gguf"] == outs["safetensors"]
    assert all(len(t) == 24 for t in outs["gguf"])


def test_per_expert_mixtral_gguf_loads_as_stacked(hf_dirs, tmp_path):
    """Mixtral files from before experts were stacked (`blk.N.ffn_gate.E.weight`) load to the same arrays."""
    write_gguf(hf_dirs["mixtral"], tmp_path / "per_expert.gguf", stack_experts=False)
    write_gguf(hf_dirs["mixtral"], tmp_path / "stacked.gguf")
    cfg_a, a = load_weights(tmp_path / "per_expert.gguf", "float32", use_cache=False)
    cfg_b, b = load_weights(tmp_path / "stacked.gguf", "float32", use_cache=False)
    assert cfg_a == cfg_b and a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
