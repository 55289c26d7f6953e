"""HF checkpoint directories: config.json plus single or sharded (indexed) safetensors."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from jaxserve.logs import progress
from jaxserve.loading.hf_names import StackedParams
from jaxserve.models.llama import ModelConfig
from jaxserve.models.registry import config_from_hf


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
    return config_from_hf(json.loads(path.read_text()))


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
        for f in files:
            if not f.is_file():
                raise ValueError(f"shard {f.name!r} named in {index.name} is missing from {str(model_dir)!r}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} holds no *.safetensors file")
    return files


def load_safetensors_params(model_dir: Path, cfg: ModelConfig, dtype: np.dtype) -> dict[str, np.ndarray]:
    stacked = StackedParams(cfg, dtype)
    files = safetensors_files(model_dir)
    names = []
    for f in files:
        with safe_open(f, framework="flax") as st:  # "flax" reads bf16 too, unlike "numpy"
            names += [(f, k) for k in st.keys()]
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}  # each file opened once
        for f, key in progress(names, "loading weights", unit="tensor"):  # a bar only on a terminal
            if f not in opened:
                opened[f] = stack.enter_context(safe_open(f, framework="flax"))
            stacked.add(key, np.asarray(opened[f].get_tensor(key)))
    return stacked.finish()
