"""The device side: the KV pool and one ahead-compiled step function per bucket.

A step runs the model over the flat token batch, writes new K/V into the (donated) pool, computes
logits for each sequence's last token only, and samples on device: only sampled ids and top-n
logprobs come back. Every bucket is compiled at start-up; a guard counts compilations after that.

Prompt logprobs ride in the same step: when some flat row has a target (the next prompt token), a
lax.cond branch computes logits for every row, in blocks of 64 rows to bound the [rows, vocab]
temporary, and returns each row's target logprob and top-n. Ordinary steps take the other branch
(zeros) and never copy those arrays to the host.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.attention import (KV_LAYOUT_PAGES, AttentionMetadata, get_attention_fn, pool_layout, pool_shape,
                                with_pool_layout, write_kv)
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.sampler import (SampleOutput, SamplingArrays, empty_penalty_state, empty_sampling_arrays,
                                     no_logit_bias, pack_logit_bias, pack_sampling, packed_sampling_size, sample,
                                     sample_with_state, unpack_sampling)
from jaxserve.engine.scheduler import StepPlan
from jaxserve.kv_quant import KVScales, is_8bit, with_kv_scales
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
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


_PROMPT_LP_BLOCK = 64  # rows of logits per block: bounds the [rows, vocab] temporary


def prompt_logprobs(model: LlamaForCausalLM, hidden: jax.Array, targets: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per flat row with targets[r] >= 0: log_softmax(logits[r])[targets[r]] and the top
    MAX_LOGPROBS (ids, logprobs) of the raw model distribution. Zeros when no row asks."""
    rows = hidden.shape[0]
    block = min(rows, _PROMPT_LP_BLOCK)

    def compute(hidden, targets):
        def one(args):
            h, t = args
            lp = jax.nn.log_softmax(model.compute_logits(h), axis=-1)
            top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
            return jnp.take_along_axis(lp, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

        pad = -rows % block  # a token bucket need not be a multiple of the block
        h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, block, hidden.shape[1])
        t = jnp.pad(targets, (0, pad)).reshape(-1, block)
        tok, ids, lps = jax.lax.map(one, (h, t))
        return (tok.reshape(-1)[:rows], ids.reshape(-1, MAX_LOGPROBS)[:rows],
                lps.reshape(-1, MAX_LOGPROBS)[:rows])

    def skip(hidden, targets):
        return (jnp.zeros(rows, jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))

    return jax.lax.cond(jnp.any(targets >= 0), compute, skip, hidden, targets)


def packed_step_size(T: int, S: int, P: int) -> int:
    return 5 * T + S * (P + 3) + 2


def pack_step(tokens: np.ndarray, md: AttentionMetadata, logits_indices: np.ndarray, targets: np.ndarray,
              token_src: np.ndarray) -> np.ndarray:
    """A step's int32 inputs as one flat array: one transfer instead of ten (see unpack_step)."""
    return np.concatenate([tokens, md.positions, md.slot_mapping, targets, token_src, md.kv_lens,
                           logits_indices, md.cu_q_lens, md.num_seqs,
                           md.page_tables.reshape(-1)]).astype(np.int32, copy=False)


def unpack_step(buf: jax.Array, T: int, S: int, P: int) -> tuple:
    """(tokens, metadata, logits indices, prompt targets, token sources) of a pack_step buffer."""
    sizes = (T, T, T, T, T, S, S, S + 1, 1, S * P)
    parts, off = [], 0
    for n in sizes:
        parts.append(buf[off: off + n])
        off += n
    tokens, positions, slots, targets, token_src, kv_lens, logits_indices, cu, num_seqs, tables = parts
    md = AttentionMetadata(positions=positions, slot_mapping=slots, kv_lens=kv_lens,
                           page_tables=tables.reshape(S, P), cu_q_lens=cu, num_seqs=num_seqs)
    return tokens, md, logits_indices, targets, token_src


@dataclass
class DeferredSample:
    """A launched model step whose sampler waits for its token mask (device futures and inputs)."""

    bucket: tuple[int, int, int]
    logits: Any
    samp_buf: Any
    history: Any
    logit_bias: Any
    prev_ids: Any
    want_logprobs: bool


class ModelRunner:
    """Runs steps of one model replica. With a mesh, the parameters are expected sharded on it
    already; the pool is split over KV heads and attention and the KV write run per shard."""

    def __init__(self, model: LlamaForCausalLM, num_pages: int, page_size: int, buckets: Buckets,
                 history_len: int, attention_backend: str = "auto", mesh: Any = None,
                 num_penalty_slots: int | None = None, kv_dtype: Any = None, kv_scales: KVScales | None = None,
                 aux_layers: tuple[int, ...] = ()):
        """kv_dtype: the pool's dtype (None: the model's); an 8-bit one needs `kv_scales`
        (jaxserve.kv_quant). aux_layers: each step also keeps the residual stream entering these
        layers for every flat row (`last_aux`, [T, len * E] on the device: an EAGLE-3 head's input)."""
        self.model = model
        self.aux_layers = tuple(aux_layers)
        self.last_aux: Any = None
        self.buckets = buckets
        self.history_len = history_len
        self.mesh = mesh
        cfg = model.cfg
        self.kv_layout = pool_layout(attention_backend, cfg.head_dim, cfg.num_kv_heads,
                                     1 if mesh is None else mesh.shape["model"])
        self.kv_shape = pool_shape(self.kv_layout, cfg.num_layers, num_pages, page_size, cfg.num_kv_heads,
                                   cfg.head_dim)
        self.kv_dtype = jnp.dtype(model.dtype if kv_dtype is None else kv_dtype)
        self.kv_scales = kv_scales
        if is_8bit(self.kv_dtype) and kv_scales is None:
            raise ValueError(f"a {self.kv_dtype.name} KV pool needs its scales (kv_quant.calibrate)")
        attention_fn, kv_write_fn = with_pool_layout(get_attention_fn(attention_backend), write_kv,
                                                     self.kv_layout, page_size)
        self._kv_sharding = self._input_sharding = None
        if mesh is not None:
            from jaxserve import parallel

            self._input_sharding = parallel.replicated(mesh)
            # A lane-dense pool only exists without tensor parallelism: replicated over the replica.
            self._kv_sharding = (parallel.kv_pool_sharding(mesh) if self.kv_layout == KV_LAYOUT_PAGES
                                 else self._input_sharding)
            if mesh.shape["model"] > 1:
                attention_fn = parallel.shard_attention(attention_fn, mesh)
                kv_write_fn = parallel.shard_kv_write(write_kv, mesh)
        if is_8bit(self.kv_dtype):  # outermost: the scales apply to whole (unsharded) heads
            if mesh is not None:
                kv_scales = jax.device_put(kv_scales, self._input_sharding)
            attention_fn, kv_write_fn = with_kv_scales(attention_fn, kv_write_fn, kv_scales, num_pages, page_size)
        self.kv_cache = jax.jit(lambda: jnp.zeros(self.kv_shape, self.kv_dtype), out_shardings=self._kv_sharding)()
        self.graphdef, self.state = nnx.split(model)

        def step(state, kv_cache, packed, prev_ids, *, bucket):
            tokens, md, logits_indices, prompt_targets, token_src = unpack_step(packed, *bucket)
            # Decodes planned while the previous step ran take their input from its sampled ids.
            tokens = jnp.where(token_src >= 0, prev_ids[jnp.maximum(token_src, 0)], tokens)
            m = nnx.merge(self.graphdef, state)
            if self.aux_layers:
                hidden, kv_cache, aux = m(tokens, md, kv_cache, attention_fn, kv_write_fn, page_size=page_size,
                                          aux_layers=self.aux_layers)
            else:
                hidden, kv_cache = m(tokens, md, kv_cache, attention_fn, kv_write_fn, page_size=page_size)
            logits = m.compute_logits(hidden[logits_indices]).astype(jnp.float32)
            out = (kv_cache, logits, prompt_logprobs(m, hidden, prompt_targets))
            return out + (aux,) if self.aux_layers else out

        # The pool keeps its sharding; logits and sampled ids come back replicated, so every
        # process of a multi-host mesh can read them from its own devices.
        rep = self._input_sharding
        out_shardings = None if mesh is None else (self._kv_sharding, rep, rep) + ((rep,) if self.aux_layers else ())
        self._step = jax.jit(step, donate_argnums=(1,), out_shardings=out_shardings, static_argnames=("bucket",))
        # The sampler is a jit of its own, per sequence bucket S: it takes seconds to compile
        # (several sampling paths), and inside the step every (T, S, P) bucket would pay that.
        # Sampled ids also come back padded to the widest sequence bucket: the next step's
        # `prev_ids`, one shape whatever the bucket of the step that sampled them.
        self.max_seqs = max(buckets.seqs_for(t) for t in buckets.token_buckets)

        # token_bitmask [S, ceil(V/32)]: the allowed tokens of constrained rows (structured output);
        # all -1 (a constant kept on the device) when no row is constrained, and then unused.
        self.mask_words = (cfg.vocab_size + 31) // 32

        # logit_bias [S, 2 * MAX_LOGIT_BIAS] (pack_logit_bias): a constant of "no bias" kept on the
        # device when no row of the step has one, like the mask.
        def sample_padded(logits, packed, history, logit_bias, prev_ids, token_bitmask, penalty_state):
            samp = unpack_sampling(packed, logits.shape[0], history, logit_bias)
            out, penalty_state = sample_with_state(logits, samp, prev_ids, penalty_state, token_bitmask)
            return out, jnp.zeros_like(prev_ids).at[: logits.shape[0]].set(out.token_ids), penalty_state

        self._sample = jax.jit(sample_padded, out_shardings=rep, donate_argnums=(6,))
        # Penalty state: a slot per running sequence (the scheduler hands them out); [slots, V]
        # of bool and int32, e.g. 16 MB at 64 sequences and SmolLM2's 49,152 tokens.
        self.num_penalty_slots = num_penalty_slots or self.max_seqs
        self.penalty_state = jax.jit(lambda: empty_penalty_state(self.num_penalty_slots, cfg.vocab_size),
                                     out_shardings=rep)()
        self._empty_histories: dict[int, jax.Array] = {}
        self._no_masks: dict[int, jax.Array] = {}
        self._no_logit_biases: dict[int, jax.Array] = {}
        self._no_prev_ids = self._constant(np.zeros(self.max_seqs, np.int32))
        # The last launched step's sampled ids, padded (what a step planned during it reads).
        self.last_sampled_ids: Any = None
        self._compiled_samplers: dict[int, Any] = {}
        self._compiled: dict[tuple[int, int, int], Any] = {}
        self.compile_seconds = 0.0
        CompileCounter.install()
        self.compiles_after_warmup_base: int | None = None
        # The last launched step's prompt-logprob arrays (device futures). Kept here rather than
        # returned, so that launch's result (what multi-host gathers) stays the sampled outputs.
        self._last_prompt_logprobs: Any = None

    @property
    def kv_cache_bytes(self) -> int:
        return int(np.prod(self.kv_shape)) * self.kv_dtype.itemsize

    def _abstract_args(self, T: int, S: int, P: int) -> tuple:
        rep = self._input_sharding  # step inputs are replicated over the replica's devices
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)  # noqa: E731
        md = AttentionMetadata(positions=i32(T), slot_mapping=i32(T), kv_lens=i32(S), page_tables=i32(S, P),
                               cu_q_lens=i32(S + 1), num_seqs=i32(1))
        samp = SamplingArrays(**{k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep)
                                 for k, v in empty_sampling_arrays(S, self.history_len).items()})
        kv = jax.ShapeDtypeStruct(self.kv_shape, self.kv_dtype, sharding=self._kv_sharding)
        return self.state, kv, i32(T), md, i32(S), samp, i32(T), i32(T), i32(self.max_seqs)

    def compile_bucket(self, bucket: tuple[int, int, int]) -> tuple[Any, Any]:
        """The compiled model step of this bucket and the compiled sampler of its S."""
        if bucket not in self._compiled:
            t0 = time.perf_counter()
            rep = self._input_sharding
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)  # noqa: E731
            kv = jax.ShapeDtypeStruct(self.kv_shape, self.kv_dtype, sharding=self._kv_sharding)
            prev_ids = i32(self.max_seqs)
            self._compiled[bucket] = self._step.lower(self.state, kv, i32(packed_step_size(*bucket)), prev_ids,
                                                      bucket=bucket).compile()
            S = bucket[1]
            if S not in self._compiled_samplers:
                logits = jax.ShapeDtypeStruct((S, self.model.cfg.vocab_size), jnp.float32, sharding=rep)
                state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                                     self.penalty_state)
                self._compiled_samplers[S] = self._sample.lower(logits, i32(packed_sampling_size(S)),
                                                                i32(S, self.history_len), i32(S, 2 * MAX_LOGIT_BIAS),
                                                                prev_ids, i32(S, self.mask_words), state).compile()
            self.compile_seconds += time.perf_counter() - t0
        return self._compiled[bucket], self._compiled_samplers[bucket[1]]

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

    def step_inputs(self, plan: StepPlan, host_history: bool = True) -> tuple:
        """The plan's device inputs: (tokens, attention metadata, logits indices, sampling arrays,
        prompt-logprob targets, token sources). A plan that builds no penalty state has no history
        array: with `host_history` an empty one is made here (what a multi-host broadcast sends),
        otherwise launch_inputs uses one kept on the device."""
        md = AttentionMetadata(plan.positions, plan.slot_mapping, plan.kv_lens, plan.page_tables,
                               plan.cu_q_lens, plan.num_seqs)
        none = np.full(plan.tokens.shape, -1, np.int32)
        targets = plan.prompt_targets if plan.prompt_targets is not None else none
        token_src = plan.token_src if plan.token_src is not None else none
        sampling = plan.sampling
        if host_history and sampling["history"] is None:
            sampling = dict(sampling, history=np.full((plan.bucket[1], self.history_len), -1, np.int32))
        if host_history and sampling["logit_bias_ids"] is None:  # (what a multi-host broadcast sends)
            empty = empty_sampling_arrays(plan.bucket[1], 1)
            sampling = dict(sampling, logit_bias_ids=empty["logit_bias_ids"],
                            logit_bias_values=empty["logit_bias_values"])
        return plan.tokens, md, plan.logits_indices, SamplingArrays(**sampling), targets, token_src

    def input_template(self, bucket: tuple[int, int, int]) -> tuple:
        """Zero host arrays shaped like step_inputs of a plan in this bucket (what a multi-host
        follower receives the leader's plan into)."""
        _, _, tokens, md, logits_indices, samp, targets, token_src, _ = self._abstract_args(*bucket)
        return host_zeros((tokens, md, logits_indices, samp, targets, token_src))

    def launch(self, plan: StepPlan, prev_ids: Any = None) -> SampleOutput | DeferredSample:
        """Dispatch one step and return without waiting for the device (its outputs are futures).
        `prev_ids`: `last_sampled_ids` of the step the plan was made during (overlap), if any.
        A plan whose mask is deferred dispatches the model step only: `sample` it with the mask."""
        return self.launch_inputs(plan.bucket, self.step_inputs(plan, host_history=False), prev_ids,
                                  plan.token_bitmask, defer_sample=plan.mask_deferred)

    def launch_inputs(self, bucket: tuple[int, int, int], inputs: tuple, prev_ids: Any = None,
                      token_bitmask: np.ndarray | None = None,
                      defer_sample: bool = False) -> SampleOutput | DeferredSample:
        """`token_bitmask`: [S, mask_words] allowed tokens when some row is constrained."""
        step_fn, _ = self.compile_bucket(bucket)
        tokens, md, logits_indices, samp, targets, token_src = inputs
        prev_ids = self._no_prev_ids if prev_ids is None else prev_ids
        history = self._empty_history(bucket[1]) if samp.history is None else samp.history
        # Two host-to-device transfers a step (plus the history, when a row's penalty state is built).
        step_buf = pack_step(tokens, md, logits_indices, targets, token_src)
        samp_buf = pack_sampling(samp)
        bias = pack_logit_bias(samp)
        bias = self._no_logit_bias(bucket[1]) if bias is None else bias
        self.kv_cache, logits, self._last_prompt_logprobs, *aux = step_fn(self.state, self.kv_cache, step_buf, prev_ids)
        self.last_aux = aux[0] if aux else None
        deferred = DeferredSample(bucket, logits, samp_buf, history, bias, prev_ids, bool(np.any(samp.want_logprobs)))
        return deferred if defer_sample else self.sample(deferred, token_bitmask)

    def sample(self, d: DeferredSample, token_bitmask: np.ndarray | None) -> SampleOutput:
        """Dispatch the sampler of a launched model step (sets `last_sampled_ids`)."""
        _, sample_fn = self.compile_bucket(d.bucket)
        bitmask = self._no_mask(d.bucket[1]) if token_bitmask is None else token_bitmask
        out, self.last_sampled_ids, self.penalty_state = sample_fn(d.logits, d.samp_buf, d.history, d.logit_bias,
                                                                  d.prev_ids, bitmask, self.penalty_state)
        # Start the copies back now: by the time the host reads them (a step later, with
        # overlap) they are there, instead of one blocking transfer per array at fetch time.
        for a in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs) if d.want_logprobs \
                else (out.token_ids,):
            if a.is_fully_addressable:  # (multi-host: read per process by gather_outputs)
                a.copy_to_host_async()
        return out

    def _constant(self, value: np.ndarray) -> Any:
        """`value` placed on this replica's devices once; a multi-host replica, whose devices this
        process cannot all address, passes the host array to each call instead."""
        sharding = self._input_sharding
        if sharding is not None and not sharding.is_fully_addressable:
            return value
        return jax.device_put(value, sharding)

    def _empty_history(self, num_seqs: int) -> jax.Array:
        """A [num_seqs, history_len] array of -1 on the device, made once per sequence bucket."""
        if num_seqs not in self._empty_histories:
            self._empty_histories[num_seqs] = self._constant(np.full((num_seqs, self.history_len), -1, np.int32))
        return self._empty_histories[num_seqs]

    def _no_mask(self, num_seqs: int) -> jax.Array:
        """A [num_seqs, mask_words] array of -1 (every token allowed) on the device, made once per
        sequence bucket: unconstrained steps transfer no mask."""
        if num_seqs not in self._no_masks:
            self._no_masks[num_seqs] = self._constant(np.full((num_seqs, self.mask_words), -1, np.int32))
        return self._no_masks[num_seqs]

    def _no_logit_bias(self, num_seqs: int) -> jax.Array:
        """pack_logit_bias of rows without a bias, on the device once per sequence bucket: steps
        without a biased row transfer nothing for it."""
        if num_seqs not in self._no_logit_biases:
            self._no_logit_biases[num_seqs] = self._constant(no_logit_bias(num_seqs))
        return self._no_logit_biases[num_seqs]

    @property
    def last_prompt_logprobs(self) -> Any:
        """The last launched step's prompt-logprob arrays (device futures)."""
        return self._last_prompt_logprobs

    def fetch_prompt_logprobs(self, arrays: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(target logprob [T], top ids [T, K], top logprobs [T, K]) on the host, of `arrays`
        (a launched step's `last_prompt_logprobs`) or of the last step: only called for a plan
        that asked for them."""
        return self.to_host(self._last_prompt_logprobs if arrays is None else arrays)

    def output_template(self, num_seqs: int) -> SampleOutput:
        """Zero host arrays shaped like the outputs of a step of num_seqs rows."""
        abstract = jax.eval_shape(lambda: sample(jnp.zeros((num_seqs, self.model.cfg.vocab_size), jnp.float32),
                                                 SamplingArrays(**empty_sampling_arrays(num_seqs, self.history_len)),
                                                 jnp.zeros(self.max_seqs, jnp.int32)))
        return host_zeros(abstract)

    @staticmethod
    def to_host(out: SampleOutput) -> SampleOutput:
        """Wait for a launched step and copy its (replicated) outputs from one of this process's devices."""
        return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), out)

    @staticmethod
    def unpack(out: SampleOutput) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Sampled ids [S] and (token logprob, top ids, top logprobs)."""
        return out.token_ids, (out.logprobs, out.top_ids, out.top_logprobs)

    def fetch(self, out: SampleOutput, with_logprobs: bool = True
              ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """Wait for a launched step: sampled ids [S] and (token logprob, top ids, top logprobs),
        or None for those when no row of the step asked for logprobs (nothing is copied then)."""
        if not with_logprobs:
            return np.asarray(out.token_ids.addressable_data(0)), None
        return self.unpack(self.to_host(out))

    def execute(self, plan: StepPlan) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return self.fetch(self.launch(plan))
