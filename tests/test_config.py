"""EngineConfig from YAML and CLI flags, and its validation."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from jaxserve.config import EngineConfig, add_engine_args, config_from_args
from jaxserve.loading import auto_dtype

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
                          (dict(attention_backend="cuda"), "attention_backend"),
                          (dict(min_token_bucket=0), "min_token_bucket"), (dict(min_token_bucket=12), "min_token_bucket")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)


def test_dtype_auto_is_bfloat16_on_accelerators_float32_on_cpu():
    assert EngineConfig().dtype == "auto"
    assert [auto_dtype(p) for p in ("cpu", "gpu", "tpu")] == ["float32", "bfloat16", "bfloat16"]


def test_token_buckets_start_at_the_floor():
    from jaxserve.engine.buckets import Buckets

    assert Buckets.create(512, 32, 64).token_buckets[:3] == (16, 32, 64)  # accelerators
    assert Buckets.create(512, 32, 64, min_tokens=1).token_buckets[:6] == (1, 2, 4, 8, 16, 32)  # CPU
    assert Buckets.create(8, 4, 4, min_tokens=1).token_buckets == (1, 2, 4, 8)
    assert Buckets.create(8, 4, 4, min_tokens=1).pick(3, 2)[:2] == (4, 4)
    assert parse("--min-token-bucket", "4").min_token_bucket == 4


SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml"))


def test_every_shipped_config_is_tested():
    assert len(SHIPPED) >= 3, SHIPPED  # a glob that finds nothing would make the tests below vacuous


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_parse(name):
    """Each file parses into EngineConfig, and the CLI takes it with --config (flags still win)."""
    import yaml

    data = yaml.safe_load((CONFIGS / name).read_text())
    cfg = EngineConfig.from_yaml(CONFIGS / name)
    for key, value in data.items():
        assert getattr(cfg, key) == value, key
    from_cli = parse("--config", str(CONFIGS / name))
    assert from_cli == cfg
    assert parse("--config", str(CONFIGS / name), "--max-num-seqs", "3").max_num_seqs == 3


def test_shipped_configs_say_nothing_stale():
    """Tensor parallelism is implemented (docs/parallelism.md): no config may claim otherwise."""
    for name in SHIPPED:
        text = (CONFIGS / name).read_text().lower()
        assert "not implemented" not in text and "only 1x1" not in text, name


def test_tpu_config_is_tensor_parallel():
    assert EngineConfig.from_yaml(CONFIGS / "llama3-8b-tpu-v5e-4.yaml").mesh == "1x4"
