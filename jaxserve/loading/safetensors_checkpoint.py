"""HF checkpoint directories: config.json plus single or sharded (indexed) safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

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
    with tqdm(total=len(names), desc="loading weights", unit="tensor", leave=False) as bar:
        for f in files:
            with safe_open(f, framework="flax") as st:
                for key in st.keys():
                    stacked.add(key, np.asarray(st.get_tensor(key)))
                    bar.update()
    return stacked.finish()
