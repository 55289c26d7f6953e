"""Gemma 3 (text, Gemma3ForCausalLM) against HF transformers: tiny random-weight checkpoints built by
transformers from a Gemma3TextConfig, logits and greedy generation through the engine (paging,
chunked prefill, prefix caching, preemption) on the XLA and the C++ CPU attention backends."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_ARCHS, hf_greedy, hf_logits, make_tiny_checkpoint, small_engine_options
from model_utils import prefill_logits

from jaxserve import SamplingParams
from jaxserve.loading import load_weights
from jaxserve.models.llama import LlamaForCausalLM

REL_TOL = 1e-4
GEMMA = TINY_ARCHS["gemma3"][1]  # head_dim 256, 6 layers (4 local, 2 global), window 16, final soft-cap
# name -> (config class, extra config, save kwargs)
TINY_GEMMA = {
    "gemma3": ("Gemma3TextConfig", GEMMA, {}),
    # head_dim 64, linear RoPE scaling on the global layers only, every other layer global, untied
    # head, attention soft-capping in the config (which transformers' Gemma 3 ignores, as we do),
    # saved as several safetensors shards behind model.safetensors.index.json.
    "gemma3_scaled": ("Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_hidden_layers=4, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, rope_theta=500_000.0,
        rope_local_base_freq=5_000.0, rope_scaling=dict(rope_type="linear", factor=4.0),
        query_pre_attn_scalar=64, attn_logit_softcapping=20.0, final_logit_softcapping=30.0,
        tie_word_embeddings=False), dict(max_shard_size="150KB")),
}


@pytest.fixture(scope="module")
def gemma_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gemma")
    return {name: make_tiny_checkpoint(name, root, (cls, extra), **save)
            for name, (cls, extra, save) in TINY_GEMMA.items()}


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def our_model(path: Path, **overrides) -> LlamaForCausalLM:
    cfg, params = load_weights(path, "float32", use_cache=False)
    model = LlamaForCausalLM(dataclasses.replace(cfg, **overrides))
    model.load_params(params)
    return model


def hf_model(path: Path, **kw):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def test_configs_read_as_gemma3(gemma_checkpoints):
    from jaxserve.loading.safetensors_checkpoint import read_config

    g = read_config(gemma_checkpoints["gemma3"])
    assert g.sliding_layers == (1, 1, 0, 1, 1, 0) and g.sliding_window == 16 and g.mixed_layers
    assert (g.head_dim, g.rope_theta, g.rope_local_theta, g.rope_scaling) == (256, 1e6, 1e4, None)
    assert (g.query_pre_attn_scalar, g.attention_scale, g.final_logit_softcap, g.attn_logit_softcap) == (
        48.0, 48 ** -0.5, 3.0, None)
    assert (g.norm_offset, g.sandwich_norms, g.hidden_act, g.embed_scale, g.qk_norm, g.tie_word_embeddings) == (
        1.0, True, "gelu_tanh", True, True, True)
    s = read_config(gemma_checkpoints["gemma3_scaled"])
    assert s.sliding_layers == (1, 0, 1, 0) and s.rope_scaling["factor"] == 4.0 and s.rope_local_scaling is None
    assert s.attn_logit_softcap is None and s.final_logit_softcap == 30.0 and not s.tie_word_embeddings
    assert len(list(gemma_checkpoints["gemma3_scaled"].glob("*.safetensors"))) > 1


def test_old_style_config_keys():
    """Hub configs written before transformers 5: rope_theta / rope_local_base_freq / rope_scaling and
    sliding_window_pattern instead of rope_parameters and layer_types."""
    from jaxserve.models.registry import config_from_hf

    hf = dict(architectures=["Gemma3ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
              num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
              rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=dict(rope_type="linear", factor=8.0),
              sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256)
    cfg = config_from_hf(hf)
    assert cfg.sliding_layers == (1, 1, 1, 1, 1, 0, 1)
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.rope_local_theta) == (1e6, 8.0, 1e4)
    assert cfg.tie_word_embeddings and cfg.sliding_window == 512
    with pytest.raises(ValueError, match="bidirectional"):
        config_from_hf({**hf, "use_bidirectional_attention": True})


@pytest.mark.parametrize("arch", list(TINY_GEMMA))
def test_gemma3_logits_match_hf(arch, gemma_checkpoints):
    path = gemma_checkpoints[arch]
    hf = hf_model(path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (1, 7, 16, 17, 40)]  # around and past the window
    ours = prefill_logits(our_model(path), prompts)
    errs = [rel_err(o, hf_logits(hf, p)) for o, p in zip(ours, prompts)]
    assert max(errs) <= REL_TOL, errs


def test_gemma3_logits_through_the_cpu_kernel(gemma_checkpoints):
    """head_dim 256 with per-layer windows through the C++ kernel (what "auto" serves on CPU)."""
    from jaxserve import cpu_kernels
    from jaxserve.attention import get_attention_fn

    if not cpu_kernels.available():
        pytest.skip("the C++ attention kernel cannot be built here")
    path = gemma_checkpoints["gemma3"]
    hf = hf_model(path)
    prompts = [list(range(3, 43)), [9, 8, 7]]
    ours = prefill_logits(our_model(path), prompts, page_size=8, attention_fn=get_attention_fn("cpu"))
    errs = [rel_err(o, hf_logits(hf, p)) for o, p in zip(ours, prompts)]
    assert max(errs) <= REL_TOL, errs


def test_gemma3_logits_through_the_pallas_kernel(gemma_checkpoints):
    """The Pallas kernel (interpret mode on CPU) under the per-layer lax.cond, head_dim 256."""
    from jaxserve.attention import get_attention_fn

    path = gemma_checkpoints["gemma3"]
    hf = hf_model(path)
    prompts = [list(range(3, 27)), [9, 8, 7]]
    ours = prefill_logits(our_model(path), prompts, page_size=8, attention_fn=get_attention_fn("pallas"))
    errs = [rel_err(o, hf_logits(hf, p)) for o, p in zip(ours, prompts)]
    assert max(errs) <= REL_TOL, errs


def test_attention_soft_cap_matches_hf_eager(gemma_checkpoints):
    """The soft-cap plumbing (Gemma3 configs' own value is ignored by transformers, and by us): with
    the cap set on our config, against HF's eager attention given the same `softcap`."""
    import torch

    path = gemma_checkpoints["gemma3"]
    hf = hf_model(path, attn_implementation="eager")
    prompts = [list(range(3, 43))]
    ours = prefill_logits(our_model(path, attn_logit_softcap=2.0), prompts)
    with torch.no_grad():
        ref = hf(torch.tensor(prompts), softcap=2.0).logits[0].numpy()
    assert rel_err(ours[0], ref) <= REL_TOL
    plain = prefill_logits(our_model(path), prompts)[0]
    assert rel_err(plain, ref) > 1e-2  # the cap of 2 does change the result


def test_bfloat16_gemma3_is_no_worse_than_hf_bfloat16(gemma_checkpoints):
    """bf16 serving drifts from float32 no more than HF's own bf16 forward does (the (1 + w) norm
    scale is computed in float32 from the stored weight, as HF does)."""
    import jax.numpy as jnp
    import torch

    path = gemma_checkpoints["gemma3"]
    cfg, params = load_weights(path, "bfloat16", use_cache=False)
    model = LlamaForCausalLM(cfg, jnp.bfloat16)
    model.load_params(params)
    prompts = [list(range(3, 40))]
    ours = prefill_logits(model, prompts)[0]
    hf = hf_model(path)
    f32 = hf_logits(hf, prompts[0])
    with torch.no_grad():
        hf16 = hf.to(torch.bfloat16)(torch.tensor(prompts)).logits[0].float().numpy()
    assert rel_err(ours, f32) <= 1.5 * rel_err(hf16, f32), (rel_err(ours, f32), rel_err(hf16, f32))


GREEDY_OPTIONS = {
    # 8-token pages, chunked prefill (16-token budget), prefix cache on (the default)
    "chunked_prefix": dict(page_size=8, max_num_batched_tokens=16, max_num_seqs=4),
    # few pages: sequences are preempted and recomputed, the prefix cache evicts first
    "preemption": dict(page_size=8, num_pages=16, max_model_len=96, max_num_batched_tokens=32),
}


def run_greedy(path: Path, backend: str, options: dict):
    from jaxserve import LLM

    hf = hf_model(path)
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 256, 20).tolist()
    # Prompts longer than the 16-token window; two share a 20-token prefix, one is short.
    first = [shared + [5, 6]]
    rest = [rng.integers(3, 256, 37).tolist(), shared + [9], [11, 12, 13]]
    llm = LLM(model=str(path), attention_backend=backend, **small_engine_options(**options))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(first, params, use_tqdm=False) + llm.generate(rest, params, use_tqdm=False)
    for prompt, out in zip(first + rest, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
    return llm, outs


@pytest.mark.parametrize("options", list(GREEDY_OPTIONS))
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_gemma3_greedy_matches_hf_generate(backend, options, gemma_checkpoints):
    llm, outs = run_greedy(gemma_checkpoints["gemma3"], backend, GREEDY_OPTIONS[options])
    if options == "chunked_prefix":
        assert outs[2].num_cached_tokens >= 16  # the shared prefix came from the cache
    else:
        assert llm.engine.scheduler.num_preemptions > 0


def test_gemma3_scaled_greedy_matches_hf_generate(gemma_checkpoints):
    run_greedy(gemma_checkpoints["gemma3_scaled"], "auto", GREEDY_OPTIONS["chunked_prefix"])


def test_gemma3_config_round_trips_through_the_weights_cache():
    """The converted-weights cache round-trips the new fields (sliding_layers as a tuple)."""
    from jaxserve.loading import config_from_dict, config_to_dict
    from jaxserve.models.registry import config_from_hf

    hf = dict(architectures=["Gemma3ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              sliding_window=8, sliding_window_pattern=2)
    cfg = config_from_hf(hf)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
