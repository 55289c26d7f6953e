"""Shared fixtures: tiny random-weight HF checkpoints of each architecture, the default model, HF references."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil
import sys
import tempfile

# One persistent XLA compilation cache for the whole run, in a fresh directory: the many engines
# the tests build (in process, in servers, in mesh workers) mostly compile the same programs (the
# same tiny shapes and buckets), and read them back instead of compiling again on 2 cores. Set
# through jax's own environment variables, before jax is imported, so that the processes the tests
# start inherit it; a process given --compilation-cache-dir (test_cli's cache tests) uses its own.
# Warm-up checks stay strict: jax reports a cache read as a backend compile, which the engine counts.
_OWN_XLA_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_XLA_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxserve-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
SHARED_XLA_CACHE = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
if "jax" in sys.modules:  # imported before this file (a plugin): too late for its environment variables
    sys.modules["jax"].config.update("jax_compilation_cache_dir", str(SHARED_XLA_CACHE))
    sys.modules["jax"].config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

import numpy as np
import pytest

TINY_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2)

# name -> (transformers config class, extra config) covering every feature of the decoder.
TINY_ARCHS = {
    "llama3": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama_mqa_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral_swa": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=16)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  use_sliding_window=False)),
    # Gemma 3: head_dim 256, local layers 0, 1, 3, 4 (window 16, RoPE base 1e4) and global 2, 5 (1e6),
    # a query scale that is not head_dim, final logit soft-capping. More variants: test_gemma3.py.
    "gemma3": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                        num_hidden_layers=6, sliding_window=16, sliding_window_pattern=3,
                                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                                        query_pre_attn_scalar=48, final_logit_softcapping=3.0)),
}


def make_tiny_checkpoint(name: str, root: Path, spec: tuple | None = None, **save_kwargs) -> Path:
    """spec: (transformers config class, extra config); TINY_ARCHS[name] when not given."""
    import torch
    import transformers

    cls_name, extra = spec or TINY_ARCHS[name]
    cfg = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gemma = cfg.model_type.startswith("gemma")
    with torch.no_grad():  # HF initialises biases to zero, which would test nothing of them
        for pname, p in model.named_parameters():
            # Gemma's norms scale by (1 + w) and start at w = 0: perturbed so that the offset is tested.
            if pname.endswith(".bias") or (gemma and "norm" in pname):
                p.normal_(0.0, 0.2)
    path = root / name
    model.save_pretrained(path, **save_kwargs)
    # The tiny models carry the default model's tokenizer (ids < 256 decode fine), as a served
    # checkpoint directory would carry its own.
    from jaxserve.loading import load_tokenizer

    load_tokenizer(None).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_checkpoint(name, root) for name in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The server tests' model: a tiny random Llama with the default tokenizer (tests/server_utils.py)."""
    from server_utils import make_full_vocab_tiny

    return make_full_vocab_tiny(tmp_path_factory.mktemp("tiny15"))


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory) -> Path:
    """One compilation cache for every server the session starts (same model, same buckets)."""
    # JAXSERVE_TEST_XLA_CACHE lets a developer keep compiled buckets between runs.
    given = os.environ.get("JAXSERVE_TEST_XLA_CACHE")
    return Path(given) if given else tmp_path_factory.mktemp("xla15")


@pytest.fixture(scope="session")
def hf_default_model():
    """HF transformers' own dequantization of the default GGUF: the reference model."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.loading import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    import torch

    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ignore_eos does
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **generate_kwargs)
    return out[0, len(ids):].tolist()


# Tests slow on 2 CPU cores (a default-model engine or server, an HF reference, a mesh or multi-host
# worker, a venv): marked `slow` here by the fixtures they use, so that no test file needs editing to
# join; a test may also carry @pytest.mark.slow itself. `make test-fast` runs `-m "not slow"`.
SLOW_FIXTURES = {
    "server",            # test_server.py: the default model behind both front ends
    "srv",               # test_server_robust.py: a server process
    "srv_wide",          # test_server_robust.py: another, for hundreds of concurrent streams
    "hf_default_model",  # transformers dequantizing the default GGUF, f32 forward passes
    "llm_default",       # test_engine.py: the default model in process
    "engines",           # test_prefix_cache.py: two default-model engines
    "default_results",   # test_parallel.py: the default model over several meshes in a worker
    "qwen3_results",
    "family_server",     # test_tool_templates.py: a server per model family
}
SLOW_TESTS = {  # each starts its own server or worker processes
    "test_api_key_and_tls", "test_biases_and_sliding_window_on_a_mesh", "test_server_refuses_a_mesh",
    "test_processes_started_with_different_settings", "test_expert_parallel_meshes_match_1x1",
    "test_sigterm_",  # test_server_robust.py: each SIGTERM test starts (and signals) a server of its own
    "test_preemptions_are_counted",
}


# The longest tests whose ground a cheaper test also covers (mesh parity of the speculative paths, a
# second multi-host test, extra parametrizations): marked `extended`. CI's `make test` deselects them
# (90 minutes on 2 cores no longer held the whole suite) and says how many it left out;
# `make test-extended` runs them. Node ids as pytest prints them; chosen by their times in a full run.
EXTENDED_TESTS = {
    "test_parallel.py::test_two_processes_share_one_mesh",  # the multi-host server test stays
    "test_parallel.py::test_biases_and_sliding_window_on_a_mesh[qwen2]",
    "test_quant_compile.py::test_a_plain_convert_fuses_into_the_dot",
    "test_cli.py::test_pip_route_without_the_test_extra",
    "test_real_clients.py::test_lm_eval_local_completions_matches_hf",
    "test_eagle3.py::test_eagle3_on_meshes_matches_1x1",
    "test_eagle3.py::test_a_head_that_predicts_the_target_is_always_accepted",
    "test_eagle3.py::test_eagle3_gives_the_tokens_of_plain_decoding[options2]",
    "test_eagle3.py::test_eagle3_on_each_architecture_gives_plain_greedy_tokens[qwen2]",
    "test_eagle3.py::test_eagle3_on_each_architecture_gives_plain_greedy_tokens[qwen3]",
    "test_eagle3.py::test_eagle3_on_each_architecture_gives_plain_greedy_tokens[mistral_swa]",
    "test_eagle3.py::test_eagle3_on_each_architecture_gives_plain_greedy_tokens[llama_mqa_tied]",
    "test_draft_model.py::test_draft_model_on_meshes_matches_1x1",
    "test_draft_model.py::test_draft_model_gives_the_tokens_of_plain_decoding[self-options2]",
    "test_draft_model.py::test_greedy_self_drafts_are_all_accepted",
    "test_speculative.py::test_speculation_gives_the_tokens_of_plain_decoding[options2]",
    "test_kv_quant.py::test_meshes_match_1x1",
    "test_kv_layout.py::test_engine_with_lane_dense_pool_equals_pages",
    "test_moe.py::test_expert_parallel_meshes_match_1x1[qwen3_moe]",  # qwen2_moe's stays
    "test_gguf_families.py::test_gguf_greedy_matches_safetensors[qwen2_moe]",
    "test_engine.py::test_batching_modes_give_identical_greedy_outputs[options3]",
    "test_engine.py::test_batching_modes_give_identical_greedy_outputs[options4]",
    "test_quantization.py::test_mesh_1x2_matches_1x1",
    "test_speculative.py::test_speculation_on_meshes_matches_1x1",
    "test_engine_overlap.py::test_overlap_equals_synchronous_engine[options2]",
    "test_gguf_families.py::test_gguf_greedy_matches_safetensors[mixtral]",
    "test_eagle3.py::test_eagle3_gives_the_tokens_of_plain_decoding[options1]",
    "test_draft_model.py::test_draft_model_gives_the_tokens_of_plain_decoding[other-options1]",
    "test_fleet_failures.py::test_restarted_replica_resyncs_its_kv_events",
    "test_kv_events.py::test_data_parallel_replicas_publish_separately",
    "test_prefix_cache.py::test_eviction_under_memory_pressure_keeps_outputs_identical",
    "test_gemma3.py::test_gemma3_greedy_matches_hf_generate[auto-preemption]",
}

SLOW_TIMEOUT = 1800  # s: the first test of a module pays for its server / worker fixture (600 s elsewhere)


def pytest_collection_modifyitems(config, items) -> None:
    unknown = set(EXTENDED_TESTS)
    for item in items:
        short = item.nodeid.split("/")[-1]
        if short in EXTENDED_TESTS:
            item.add_marker(pytest.mark.extended)
            unknown.discard(short)
        name = getattr(item, "originalname", item.name)
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or any(name.startswith(t) for t in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))
    whole_suite = all(Path(a).resolve() == Path(config.rootpath, "tests").resolve() for a in config.args)
    if unknown and whole_suite:  # a renamed test would otherwise slip back into CI unnoticed
        raise pytest.UsageError(f"EXTENDED_TESTS names tests that do not exist: {sorted(unknown)}")


_extended_left_out: list[str] = []


def pytest_deselected(items) -> None:
    _extended_left_out.extend(i.nodeid for i in items if i.get_closest_marker("extended"))


@pytest.fixture(scope="module", autouse=True)
def release_compiled_code():
    """After each test module, drop what it compiled. Every live XLA CPU executable holds its JIT
    code in memory mappings of its own, and jit caches keep executables alive: without this,
    test_logit_bias.py alone left 15,058 mappings in the process (5,281 with it; Linux allows
    65,530 by default, vm.max_map_count). The whole suite runs in one process, and CI at stop 28
    segfaulted inside an XLA compile 83% of the way through, the suspected effect of that limit."""
    yield
    import gc

    import jax

    _map_counts.append(_memory_mappings())
    gc.collect()
    jax.clear_caches()
    gc.collect()


_map_counts: list[int] = []


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def pytest_unconfigure(config) -> None:
    if _OWN_XLA_CACHE:
        shutil.rmtree(SHARED_XLA_CACHE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter) -> None:
    if _extended_left_out:
        terminalreporter.write_line(f"extended tests left out: {len(_extended_left_out)} "
                                    "(make test-extended runs them; tests/conftest.py EXTENDED_TESTS)")
    if _map_counts:  # how close the run came to the limit above, for the next time a compile crashes
        terminalreporter.write_line(f"memory mappings at a module's end, before its release: peak {max(_map_counts)}")


def small_engine_options(**kw) -> dict:
    """Engine options for tests: small buckets, compiled on demand, no persistent cache."""
    opts = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=128, page_size=16,
                compile_ahead=False, compilation_cache_dir=None, show_progress=False)
    opts.update(kw)
    return opts
