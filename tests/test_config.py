"""EngineConfig from YAML and CLI flags, and its validation."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from jaxserve.config import EngineConfig, add_engine_args, config_from_args

CONFIGS = Path(__file__).parent.parent / "configs"


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_yaml_then_flags_override():
    cfg = parse("--config", str(CONFIGS / "smollm2-cpu.yaml"), "--max-num-seqs", "8", "--no-prefix-caching")
    assert cfg.max_num_seqs == 8 and cfg.enable_prefix_caching is False and cfg.max_num_batched_tokens == 512


def test_unknown_yaml_key_and_bad_values(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqz: 4\n")
    with pytest.raises(ValueError, match="max_num_seqz"):
        EngineConfig.from_yaml(bad)
    for kwargs, field in [(dict(max_num_seqs=0), "max_num_seqs"), (dict(page_size=12), "page_size"),
                          (dict(num_pages=1), "num_pages"), (dict(scheduler="fifo"), "scheduler"),
                          (dict(mesh="4"), "mesh"), (dict(mesh="0x2"), "mesh"), (dict(dtype="int4"), "dtype"),
                          (dict(attention_backend="cuda"), "attention_backend")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)


@pytest.mark.parametrize("name", ["llama3-8b-h100.yaml", "smollm2-cpu.yaml"])
def test_shipped_configs_parse(name):
    EngineConfig.from_yaml(CONFIGS / name)
