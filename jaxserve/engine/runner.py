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

from jaxserve.attention import AttentionMetadata, get_attention_fn, write_kv
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.sampler import SampleOutput, SamplingArrays, empty_sampling_arrays, sample
from jaxserve.engine.scheduler import StepPlan
from jaxserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def host_zeros(tree: Any) -> Any:
    """Zero host arrays shaped like the arrays (or ShapeDtypeStructs) of `tree`."""
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), tree)


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
    """Runs steps of one model replica. With a mesh, the parameters are expected sharded on it
    already; the pool is split over KV heads and attention and the KV write run per shard."""

    def __init__(self, model: LlamaForCausalLM, num_pages: int, page_size: int, buckets: Buckets,
                 history_len: int, attention_backend: str = "auto", mesh: Any = None):
        self.model = model
        self.buckets = buckets
        self.history_len = history_len
        self.mesh = mesh
        cfg = model.cfg
        self.kv_shape = (cfg.num_layers, num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)
        attention_fn, kv_write_fn = get_attention_fn(attention_backend), write_kv
        self._kv_sharding = self._input_sharding = None
        if mesh is not None:
            from jaxserve import parallel

            self._kv_sharding, self._input_sharding = parallel.kv_pool_sharding(mesh), parallel.replicated(mesh)
            if mesh.shape["model"] > 1:
                attention_fn = parallel.shard_attention(attention_fn, mesh)
                kv_write_fn = parallel.shard_kv_write(write_kv, mesh)
        self.kv_cache = jax.jit(lambda: jnp.zeros(self.kv_shape, model.dtype), out_shardings=self._kv_sharding)()
        self.graphdef, self.state = nnx.split(model)

        def step(state, kv_cache, tokens, md: AttentionMetadata, logits_indices, samp: SamplingArrays):
            m = nnx.merge(self.graphdef, state)
            hidden, kv_cache = m(tokens, md, kv_cache, attention_fn, kv_write_fn)
            logits = m.compute_logits(hidden[logits_indices])
            return kv_cache, sample(logits, samp)

        # The pool keeps its sharding; sampled ids come back replicated, so every process of a
        # multi-host mesh can read them from its own devices.
        out_shardings = None if mesh is None else (self._kv_sharding, self._input_sharding)
        self._step = jax.jit(step, donate_argnums=(1,), out_shardings=out_shardings)
        self._compiled: dict[tuple[int, int, int], Any] = {}
        self.compile_seconds = 0.0
        CompileCounter.install()
        self.compiles_after_warmup_base: int | None = None

    @property
    def kv_cache_bytes(self) -> int:
        return int(np.prod(self.kv_shape)) * jnp.dtype(self.model.dtype).itemsize

    def _abstract_args(self, T: int, S: int, P: int) -> tuple:
        rep = self._input_sharding  # step inputs are replicated over the replica's devices
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)  # noqa: E731
        md = AttentionMetadata(positions=i32(T), slot_mapping=i32(T), kv_lens=i32(S), page_tables=i32(S, P),
                               cu_q_lens=i32(S + 1), num_seqs=i32(1))
        samp = SamplingArrays(**{k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep)
                                 for k, v in empty_sampling_arrays(S, self.history_len).items()})
        kv = jax.ShapeDtypeStruct(self.kv_shape, self.model.dtype, sharding=self._kv_sharding)
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

    @staticmethod
    def step_inputs(plan: StepPlan) -> tuple:
        """The plan's device inputs: (tokens, attention metadata, logits indices, sampling arrays)."""
        md = AttentionMetadata(plan.positions, plan.slot_mapping, plan.kv_lens, plan.page_tables,
                               plan.cu_q_lens, plan.num_seqs)
        return plan.tokens, md, plan.logits_indices, SamplingArrays(**plan.sampling)

    def input_template(self, bucket: tuple[int, int, int]) -> tuple:
        """Zero host arrays shaped like step_inputs of a plan in this bucket (what a multi-host
        follower receives the leader's plan into)."""
        _, _, tokens, md, logits_indices, samp = self._abstract_args(*bucket)
        return host_zeros((tokens, md, logits_indices, samp))

    def launch(self, plan: StepPlan) -> SampleOutput:
        """Dispatch one step and return without waiting for the device (its outputs are futures)."""
        return self.launch_inputs(plan.bucket, self.step_inputs(plan))

    def launch_inputs(self, bucket: tuple[int, int, int], inputs: tuple) -> SampleOutput:
        fn = self.compile_bucket(bucket)
        self.kv_cache, out = fn(self.state, self.kv_cache, *inputs)
        return out

    def output_template(self, num_seqs: int) -> SampleOutput:
        """Zero host arrays shaped like the outputs of a step of num_seqs rows."""
        abstract = jax.eval_shape(lambda: sample(jnp.zeros((num_seqs, self.model.cfg.vocab_size), jnp.float32),
                                                 SamplingArrays(**empty_sampling_arrays(num_seqs, self.history_len))))
        return host_zeros(abstract)

    @staticmethod
    def to_host(out: SampleOutput) -> SampleOutput:
        """Wait for a launched step and copy its (replicated) outputs from one of this process's devices."""
        return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), out)

    @staticmethod
    def unpack(out: SampleOutput) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Sampled ids [S] and (token logprob, top ids, top logprobs)."""
        return out.token_ids, (out.logprobs, out.top_ids, out.top_logprobs)

    def fetch(self, out: SampleOutput) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Wait for a launched step: sampled ids [S] and (token logprob, top ids, top logprobs)."""
        return self.unpack(self.to_host(out))

    def execute(self, plan: StepPlan) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return self.fetch(self.launch(plan))
