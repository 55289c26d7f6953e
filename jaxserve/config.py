"""EngineConfig: every engine option in one dataclass; YAML files and CLI flags map onto it."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None: the embedded default model
    mesh: str = "1x1"
    # "auto": bfloat16 on TPU and GPU, float32 on CPU (XLA's CPU bf16 dots are ~20x slower than f32),
    # resolved at start-up by the engine (`LLMEngine.config.dtype` holds the choice).
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = 2048  # None: the model's own context length
    page_size: int = 16
    num_pages: int | None = None  # None: sized from kv_cache_memory
    kv_cache_memory: float = 1.0  # GiB for the KV pool when num_pages is None
    # The KV pool's dtype: "auto" (the model's), "float32", "bfloat16", "float16", "int8" or "fp8_e4m3"
    # ("fp8" = e4m3, as in vLLM). An 8-bit pool holds twice bfloat16's tokens in the same memory,
    # with static scales per layer, head and channel, calibrated at start-up (jaxserve/kv_quant.py).
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "auto" | "xla" | "pallas" | "cpu" | "xla-reference" (the test oracle)
    scheduler: str = "continuous"  # or "static"
    # Plan and launch step N+1 before reading step N's results (vLLM's async scheduling, SGLang's
    # overlap scheduler): host work hides behind the device. False: the synchronous reference.
    async_scheduling: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" | "lpm" (longest prefix match)
    max_waiting: int = 1024  # bounded queue: past it, submissions are refused
    compile_ahead: bool = True  # compile every bucket at start-up
    # The smallest step (token) bucket. None: 1 on CPU, where a dot's cost grows with its rows;
    # 16 on accelerators, where a 16-row tile costs what one row does.
    min_token_bucket: int | None = None
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"  # None: no persistent cache
    # KV-cache events for KV-aware routers, vLLM's --kv-events-config JSON (a mapping in YAML), e.g.
    # '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'.
    # Off by default; see jaxserve/cache/kv_events.py.
    kv_events_config: str | None = None
    # The block hash KV events carry (vLLM's flag of the same name): "sha256_cbor", "sha256", or
    # "siphash13" (older vllm-router kv_aware keys). See jaxserve/cache/block_hash.py.
    prefix_caching_hash_algo: str = "sha256_cbor"
    # Speculative decoding, vLLM's --speculative-config JSON (a mapping in YAML), e.g.
    # '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'. Off by default;
    # see jaxserve/engine/speculative.py. Steps then run synchronously (no overlap).
    speculative_config: str | dict | None = None
    # Weight-only quantization: "none", "int8" (affine int8, a float32 scale and offset per 32
    # inputs, quantized at load from any checkpoint and cached) or "gguf" (a GGUF file's Q8_0 /
    # Q4_0 / Q4_1 / Q4_K weights served as stored); see jaxserve/quantization.py.
    quantization: str = "none"
    # Float32 on one CPU device: steps of at most 8 rows compute their projections with a kernel of
    # ours that reads the stacked layer weights in place (XLA copies each layer's slice first):
    # 1.31x faster decode at concurrency 1 through the server (docs/benchmarks.md). Off by default: a row's logits
    # then differ in the last bits between steps of <= 8 and > 8 rows, so outputs are no longer
    # independent of batch composition (seeded sampling, prompt logprobs of n siblings).
    cpu_dense_kernel: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "max_waiting"):
            positive(name)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.min_token_bucket is not None:
            positive("min_token_bucket")
            if self.min_token_bucket & (self.min_token_bucket - 1):
                raise ValueError(f"min_token_bucket must be a power of two, got {self.min_token_bucket}")
        if self.num_pages is not None:
            positive("num_pages")
            if self.num_pages < 2:
                raise ValueError("num_pages must be at least 2 (page 0 is the reserved null page)")
        if self.max_model_len is not None:
            positive("max_model_len")
        if not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory!r}")
        from jaxserve.kv_quant import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.scheduler not in ("continuous", "static"):
            raise ValueError(f"scheduler must be 'continuous' or 'static', got {self.scheduler!r}")
        if self.scheduling_policy not in ("fcfs", "priority", "lpm"):
            raise ValueError(f"scheduling_policy must be 'fcfs', 'priority' or 'lpm', got {self.scheduling_policy!r}")
        from jaxserve.attention import BACKENDS

        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {self.attention_backend!r}")
        from jaxserve.parallel import parse_mesh

        data, model = parse_mesh(self.mesh)  # whether the devices can form it is checked at start-up
        self.mesh = f"{data}x{model}"
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        from jaxserve.quantization import check_method

        self.quantization = check_method(self.quantization)
        from jaxserve.cache.block_hash import HASH_ALGOS
        from jaxserve.cache.kv_events import KVEventsConfig

        KVEventsConfig.parse(self.kv_events_config)  # a bad JSON fails at start-up, not at the first step
        from jaxserve.engine.speculative import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}; "
                             f"got {self.prefix_caching_hash_algo!r}")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "EngineConfig":
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown option(s) in {path}: {sorted(unknown)}")
        return cls(**{**data, **overrides})


def add_engine_args(parser: Any) -> None:
    """Every EngineConfig field as a kebab-case flag (defaults None: YAML or the dataclass decide)."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        elif f.name == "quantization":
            from jaxserve.quantization import METHODS

            parser.add_argument(flag, dest=f.name, default=None, choices=METHODS,
                                help="weight-only quantization (int8: a scale and offset per 32 inputs; "
                                     "gguf: a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K weights as stored)")
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], None)
            parser.add_argument(flag, dest=f.name, default=None,
                                type=kind if kind else _int_float_or_str)
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    parser.add_argument("--config", dest="config_file", default=None, help="YAML file of engine options")


def _int_float_or_str(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return None if value.lower() == "none" else value


def config_from_args(args: Any) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if getattr(args, "config_file", None):
        return EngineConfig.from_yaml(args.config_file, **overrides)
    return EngineConfig(**overrides)
