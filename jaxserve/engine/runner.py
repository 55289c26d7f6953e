"""The device side: the KV pool and one ahead-compiled step function per bucket.

A step runs the model over the flat token batch, writes new K/V into the (donated) pool, computes
logits for each sequence's last token only, and samples on device: only sampled ids and top-n
logprobs come back. Every bucket is compiled at start-up; a guard counts compilations after that.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.attention import AttentionMetadata, get_attention_fn
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.sampler import SampleOutput, SamplingArrays, empty_sampling_arrays, sample
from jaxserve.engine.scheduler import StepPlan
from jaxserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class CompileCounter:
    """Counts XLA backend compilations process-wide (jax's monitoring events)."""

    count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return

        def listener(event: str, duration: float, **_: Any) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                cls.count += 1

        jax.monitoring.register_event_duration_secs_listener(listener)
        cls._installed = True


def enable_compilation_cache(cache_dir: str | None) -> None:
    if not cache_dir:
        return
    path = os.path.expanduser(cache_dir)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_pages: int, page_size: int, buckets: Buckets,
                 history_len: int, attention_backend: str = "auto"):
        self.model = model
        self.buckets = buckets
        self.history_len = history_len
        cfg = model.cfg
        self.kv_shape = (cfg.num_layers, num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = jnp.zeros(self.kv_shape, model.dtype)
        self.graphdef, self.state = nnx.split(model)
        attention_fn = get_attention_fn(attention_backend)

        def step(state, kv_cache, tokens, md: AttentionMetadata, logits_indices, samp: SamplingArrays):
            m = nnx.merge(self.graphdef, state)
            hidden, kv_cache = m(tokens, md, kv_cache, attention_fn)
            logits = m.compute_logits(hidden[logits_indices])
            return kv_cache, sample(logits, samp)

        self._step = jax.jit(step, donate_argnums=(1,))
        self._compiled: dict[tuple[int, int, int], Any] = {}
        self.compile_seconds = 0.0
        CompileCounter.install()
        self.compiles_after_warmup_base: int | None = None

    @property
    def kv_cache_bytes(self) -> int:
        return int(np.prod(self.kv_shape)) * jnp.dtype(self.model.dtype).itemsize

    def _abstract_args(self, T: int, S: int, P: int) -> tuple:
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        md = AttentionMetadata(positions=i32(T), slot_mapping=i32(T), kv_lens=i32(S), page_tables=i32(S, P),
                               cu_q_lens=i32(S + 1), num_seqs=i32(1))
        samp = SamplingArrays(**{k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                                 for k, v in empty_sampling_arrays(S, self.history_len).items()})
        kv = jax.ShapeDtypeStruct(self.kv_shape, self.model.dtype)
        return self.state, kv, i32(T), md, i32(S), samp

    def compile_bucket(self, bucket: tuple[int, int, int]) -> Any:
        if bucket not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[bucket] = self._step.lower(*self._abstract_args(*bucket)).compile()
            self.compile_seconds += time.perf_counter() - t0
        return self._compiled[bucket]

    def warmup(self, show_progress: bool = True) -> None:
        """Compile every bucket ahead (the persistent compilation cache makes a second start fast)."""
        for bucket in tqdm(self.buckets.all(), desc="compiling step buckets", unit="bucket",
                           disable=not show_progress, leave=False):
            self.compile_bucket(bucket)
        self.compiles_after_warmup_base = CompileCounter.count

    @property
    def compiles_after_warmup(self) -> int:
        if self.compiles_after_warmup_base is None:
            return 0
        return CompileCounter.count - self.compiles_after_warmup_base

    def execute(self, plan: StepPlan) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Run one step; returns sampled ids [S] and (token logprob, top ids, top logprobs)."""
        fn = self.compile_bucket(plan.bucket)
        md = AttentionMetadata(plan.positions, plan.slot_mapping, plan.kv_lens, plan.page_tables,
                               plan.cu_q_lens, plan.num_seqs)
        samp = SamplingArrays(**plan.sampling)
        self.kv_cache, out = fn(self.state, self.kv_cache, plan.tokens, md, plan.logits_indices, samp)
        out: SampleOutput = jax.device_get(out)
        return out.token_ids, (out.logprobs, out.top_ids, out.top_logprobs)
