"""Our Flax decoder against HF transformers: logits and greedy generation, every architecture."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_ARCHS, hf_greedy, hf_logits, small_engine_options
from model_utils import prefill_logits

from jaxserve import SamplingParams
from jaxserve.loading import load_tokenizer, load_weights
from jaxserve.models.llama import LlamaForCausalLM

REL_TOL = 1e-4


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def our_model(path, dtype="float32"):
    cfg, params = load_weights(path, dtype, use_cache=False)
    model = LlamaForCausalLM(cfg)
    model.load_params(params)
    return model


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_logits_match_hf(arch, tiny_checkpoints):
    import transformers

    path = tiny_checkpoints[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (1, 7, 16, 17, 40)]
    ours = prefill_logits(our_model(path), prompts)
    errs = [rel_err(o, hf_logits(hf, p)) for o, p in zip(ours, prompts)]
    assert max(errs) <= REL_TOL, errs


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_greedy_matches_hf_generate(arch, tiny_checkpoints):
    import transformers

    path = tiny_checkpoints[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 20)]
    from jaxserve import LLM

    llm = LLM(model=str(path), **small_engine_options())
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
        assert out.outputs[0].finish_reason == "length"


def test_pallas_backend_through_the_engine_matches_hf(tiny_checkpoints):
    """attention_backend="pallas" on CPU runs the Pallas kernel in interpret mode inside the engine."""
    import transformers

    from jaxserve import LLM

    path = tiny_checkpoints["llama3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = list(range(3, 23))
    llm = LLM(model=str(path), attention_backend="pallas", **small_engine_options())
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def test_xla_backend_through_the_engine_matches_hf(tiny_checkpoints):
    """attention_backend="xla": the XLA serving path (what CPUs without a compiler use) in the engine."""
    import transformers

    from jaxserve import LLM

    path = tiny_checkpoints["mistral_swa"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = list(range(3, 43))  # longer than the 16-token sliding window
    llm = LLM(model=str(path), attention_backend="xla", **small_engine_options())
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def test_default_model_logits_match_hf(hf_default_model):
    tok = load_tokenizer(None)
    prompts = [tok(t).input_ids for t in ("The capital of France is",
                                          "Here is a longer prompt about the weather in Paris and London, "
                                          "written so that it spans more than a couple of KV pages. " * 2)]
    ours = prefill_logits(our_model(None), prompts)
    errs = [rel_err(o, hf_logits(hf_default_model, p)) for o, p in zip(ours, prompts)]
    print("default model logits rel err:", errs)
    assert max(errs) <= REL_TOL, errs


def test_default_model_greedy_matches_hf(hf_default_model):
    from jaxserve import LLM

    llm = LLM(**small_engine_options())
    prompt = "The capital of France is"
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_default_model, out.prompt_token_ids, 32)
    assert "Paris" in out.outputs[0].text


def test_gguf_and_safetensors_give_same_logits(hf_default_model, tmp_path):
    """The same weights through both loaders: HF's dequantization saved as safetensors vs our GGUF path."""
    tok = load_tokenizer(None)
    from safetensors.torch import save_file

    (tmp_path / "st").mkdir()
    tied = hf_default_model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in hf_default_model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, tmp_path / "st" / "model.safetensors")
    config = hf_default_model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]  # GGUF-born configs leave it out
    (tmp_path / "st" / "config.json").write_text(json.dumps(config))
    ids = [tok("Safetensors and GGUF should agree.").input_ids]
    a = prefill_logits(our_model(None), ids)[0]
    b = prefill_logits(our_model(tmp_path / "st"), ids)[0]
    assert rel_err(a, b) <= 1e-5


def test_orbax_round_trip_is_exact(tiny_checkpoints, tmp_path):
    from jaxserve.loading.orbax_checkpoint import restore_params, save_params

    _, params = load_weights(tiny_checkpoints["qwen3"], use_cache=False)
    save_params(tmp_path / "ckpt", params)
    restored = restore_params(tmp_path / "ckpt")
    assert set(restored) == set(params)
    for k in params:
        assert restored[k].dtype == params[k].dtype and np.array_equal(restored[k], params[k]), k


def test_converted_weights_cache_is_used(tiny_checkpoints, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    (entry,) = _stale_cache_entry(tiny_checkpoints["llama3"], tmp_path)
    cfg1, p1 = load_weights(tiny_checkpoints["llama3"])
    assert [p.name for p in (tmp_path / "converted").iterdir()] == [entry.name]  # no staging left behind
    assert (entry / "config.json").is_file() and not (entry / "junk").exists()  # the partial entry replaced
    with caplog.at_level(logging.INFO, logger="jaxserve.loading"):
        cfg2, p2 = load_weights(tiny_checkpoints["llama3"])
    assert "restoring converted weights" in caplog.text
    assert cfg1 == cfg2 and all(np.array_equal(p1[k], p2[k]) for k in p1)


def _stale_cache_entry(model: Path, cache: Path) -> list[Path]:
    """What an interrupted save of an older jaxserve left: the entry's directory without config.json."""
    from jaxserve.loading import _cache_key

    entry = cache / "converted" / _cache_key(model, "float32")
    (entry / "params.orbax-checkpoint-tmp").mkdir(parents=True)
    (entry / "junk").write_text("")
    return [entry]


_LOAD_AT_ONCE = """
import sys, time
from pathlib import Path
from jaxserve.loading import load_weights
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.01)
cfg, params = load_weights(sys.argv[1])
print(sum(float(abs(v).sum()) for v in params.values()))
"""


def test_replicas_converting_at_once_share_one_cache_entry(tiny_checkpoints, tmp_path):
    """Replicas started together on one cache directory (pods of a node, a benchmark's servers)
    each convert and publish; none fails, and one complete entry remains. Saving straight into the
    entry made the second replica die on orbax's FileExistsError."""
    go = tmp_path / "go"
    env = {**os.environ, "JAXSERVE_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_AT_ONCE, str(tiny_checkpoints["llama3"]), str(go)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    time.sleep(5)  # all three import jax and wait on the same file
    go.write_text("")
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert len({out.strip() for out, _ in results}) == 1
    (entry,) = (tmp_path / "cache" / "converted").iterdir()
    assert (entry / "config.json").is_file() and (entry / "params").is_dir()


def test_bfloat16_model_is_close(tiny_checkpoints):
    path = tiny_checkpoints["llama3"]
    prompts = [list(range(3, 30))]
    f32 = prefill_logits(our_model(path), prompts)[0]
    bf16 = prefill_logits(our_model(path, "bfloat16"), prompts)[0]
    assert rel_err(bf16, f32) < 5e-2


def test_bad_model_paths_and_architectures(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_weights(tmp_path / "nope")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_weights(tmp_path / "gpt2", use_cache=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_weights(tmp_path / "empty", use_cache=False)
    with pytest.raises(ValueError, match="dtype"):
        load_weights(None, dtype="int8")


def test_wrong_shape_is_a_clear_error(tiny_checkpoints, tmp_path):
    import shutil

    src = tiny_checkpoints["qwen2"]
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        load_weights(dst, use_cache=False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(n=0), "n"), (dict(logprobs=99), "logprobs"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
