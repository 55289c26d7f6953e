"""LLMEngine: the synchronous core that owns the model, the page pool, the scheduler and the runner.

`step()` runs one scheduled batch on the device and returns what each request gained. The offline
LLM API drives it in a loop; the AsyncEngine drives it from its own thread.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import resolve_backend
from jaxserve.cache.page_pool import PagePool
from jaxserve.config import EngineConfig
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.draft_model import DraftModelProposer
from jaxserve.engine.eagle3 import Eagle3Proposer
from jaxserve.engine.request import Request
from jaxserve.engine.runner import CompileCounter, ModelRunner, enable_compilation_cache
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.speculative import SpecDecodeStats, SpeculativeConfig
from jaxserve.engine.structured import GrammarCompiler
from jaxserve.kv_quant import CALIBRATION_TEXT, KVScales, calibrate, is_8bit, storage_dtype
from jaxserve.models.llama import rope_inv_freq
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """One request's state after a step. `outputs[0].text/.token_ids` hold everything so far;
    `delta_text/delta_token_ids` what this step added (what a stream sends)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    queue_seconds: float | None = None  # arrival to first scheduling
    # With SamplingParams.prompt_logprobs: one entry per prompt token, vLLM's shape (the first is
    # None; each dict holds the prompt token's own logprob, first, and the top-n). Set on the
    # first output only (the one with the first sampled token), None on later ones.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Set when this request alone failed inside the engine (its inputs could not be prepared):
    # the request is finished with finish_reason "abort" and the front ends report the error.
    error: str | None = None
    # With SamplingParams.logprobs: the dicts of delta_token_ids (what a stream sends).
    delta_logprobs: list[dict[int, float]] | None = None


@dataclass
class _Tracked:
    """Engine-side state of one request: detokenization and stop strings."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    replica: "Replica"
    emitted_chars: int = 0
    emitted_tokens: int = 0
    pushed_tokens: int = 0  # output tokens given to the detokenizer
    text: str = ""
    sent_prompt_logprobs: bool = False
    logprob_dicts: list[dict[int, float]] = field(default_factory=list)  # built once per token
    # False: outputs before the final one carry only the deltas (their outputs[0] is empty), so
    # that a step's work per request does not grow with the length of its output.
    cumulative: bool = True


def check_logit_bias_vocab(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias ids must be tokens of the served model (SamplingParams checked the rest)."""
    bad = next((t for t in (params.logit_bias or ()) if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad}")


def _encode_prompt(tokenizer: Any, prompt: str | Sequence[int], vocab_size: int) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, list(tokenizer(prompt, add_special_tokens=True).input_ids)
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt_token_ids must not be empty")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab_size}), got {t!r}")
    return None, [int(t) for t in ids]


@dataclass
class _Launched:
    """A dispatched step whose results have not been read yet."""

    replica: "Replica"
    plan: Any
    sampled: Any  # SampleOutput (device futures); a DeferredSample until step() samples it
    sampled_ids: Any  # the sampled ids padded to the widest bucket: a next step's prev_ids
    prompt_logprobs: Any


@dataclass
class Replica:
    """One data-parallel replica: its devices' share of the model, page pool, cache and batch."""

    index: int
    pool: PagePool
    prefix_cache: Any
    scheduler: Scheduler
    runner: ModelRunner
    # Speculative methods "draft_model" (its own model and pool) and "eagle3" (a head fed by the runner).
    drafter: DraftModelProposer | Eagle3Proposer | None = None
    num_requests: int = 0  # routed here since start-up

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)


# Requests a replica holding a prompt's prefix may be ahead of the least loaded one and still get
# it: recomputing a prefix costs more than queueing behind a few requests (SGLang's cache-aware
# router balances the same way, by an absolute and a relative threshold).
BALANCE_SLACK = 8


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        from jaxserve import parallel
        from jaxserve.loading import auto_dtype, load_tokenizer, load_weights, resolve_dtype
        from jaxserve.models.llama import LlamaForCausalLM

        if config.dtype == "auto":
            platform = jax.default_backend()
            config = dataclasses.replace(config, dtype=auto_dtype(platform))
            log.info("dtype auto: %s on %s", config.dtype, platform)
        self.config = config
        enable_compilation_cache(config.compilation_cache_dir)
        t0 = time.perf_counter()
        self.mesh = parallel.make_mesh(config.mesh)
        num_replicas, tp = parallel.parse_mesh(config.mesh)
        cfg, params = load_weights(config.model, config.dtype, quantization=config.quantization)
        parallel.check_splittable(cfg, tp)
        quantized = config.quantization != "none"
        self.model_config = cfg
        self.tokenizer = load_tokenizer(config.model)
        dtype = resolve_dtype(config.dtype)
        layout = parallel.head_layout(cfg, tp)
        if not layout.is_identity:
            log.info(parallel.describe_layout(cfg, layout, tp))
        if quantized and not layout.is_identity:
            if config.quantization == "gguf":
                raise ValueError(f"--quantization gguf over a model axis of {tp}: the heads would be re-laid (padded or "
                                 f"repeated), which needs dequantized weights; use --quantization int8 or a model axis "
                                 f"that divides the {cfg.num_kv_heads} KV heads")
            # Heads are re-laid in float and quantized again: a round trip that changes no value
            # (a group's min and max map back to the same scale and offset, every q to itself).
            from jaxserve.quantization import dequantize_params, quantize_params

            attn = ("wq", "wk", "wv", "wo")
            served_cfg, params = parallel.apply_head_layout(cfg, dequantize_params(params, attn), layout)
            params = quantize_params(served_cfg, params, attn)
        else:
            served_cfg, params = parallel.apply_head_layout(cfg, params, layout)
        if quantized:
            from jaxserve.quantization import check_splittable, describe

            check_splittable(served_cfg, tp)
            self.weight_bytes = sum(int(a.nbytes) for a in params.values())
            log.info("quantization %s: %s", config.quantization, describe(params, dtype))
        else:
            self.weight_bytes = sum(int(a.size) * np.dtype(dtype).itemsize for a in params.values())
            log.info("weights %.1f MiB (%s)", self.weight_bytes / 2**20, np.dtype(dtype).name)
        self.served_model_config = served_cfg
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.kv_dtype = storage_dtype(config.kv_cache_dtype, dtype, self.mesh.devices.flat[0].platform)
        page_size = self._page_size(config, served_cfg, tp)
        # kv_cache_memory is per device: each device holds 1/tp of the (served) KV heads.
        bytes_per_page = served_cfg.kv_bytes_per_token // 4 * self.kv_dtype.itemsize * page_size // tp
        num_pages = config.num_pages or max(2, int(config.kv_cache_memory * 2**30 // bytes_per_page))
        self.num_pages = num_pages  # per replica
        max_pages_per_seq = -(-self.max_model_len // page_size)
        min_tokens = config.min_token_bucket or (1 if self.mesh.devices.flat[0].platform == "cpu" else 16)
        self.buckets = Buckets.create(config.max_num_batched_tokens, config.max_num_seqs, max_pages_per_seq,
                                      min_tokens=min_tokens)
        self.replicas: list[Replica] = []
        make_event_recorder = self._kv_event_recorders(config)
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        draft = None
        if self.speculative is not None:
            log.info("speculative decoding: %s, up to %d draft tokens a sequence", self.speculative.method,
                     self.speculative.num_speculative_tokens)
            if self.speculative.method == "draft_model":
                draft = self._load_draft_model(cfg, tp, config.dtype)
        head = self._load_eagle3_head(cfg) if self.speculative is not None and self.speculative.method == "eagle3" \
            else None

        def place(model_cfg: Any, served: Any, weights: Any, mesh: Any, quantization: str = "none") -> LlamaForCausalLM:
            arrays = parallel.shard_params(weights, mesh, dtype)  # each device gets only its slices
            inv_freq = jax.device_put(rope_inv_freq(model_cfg), parallel.replicated(mesh))
            return LlamaForCausalLM.from_arrays(served, arrays, dtype, inv_freq, quantization=quantization,
                                                dense_impl="auto" if config.cpu_dense_kernel else "xla")

        kv_scales = None
        for index, mesh in enumerate(parallel.replica_meshes(self.mesh)):
            model = place(cfg, served_cfg, params, mesh, config.quantization)
            if is_8bit(self.kv_dtype) and kv_scales is None:  # replicas share the first one's scales
                kv_scales = self._calibrate_kv_scales(model, page_size)
            if quantized:
                log.info("quantized linear layers run on %s", "the CPU kernel (jax.ffi)"
                         if model.quant_impl == "kernel" else "XLA (weights dequantized inside the dot)")
            pool = PagePool(num_pages, page_size)
            prefix_cache = None
            if config.enable_prefix_caching:
                from jaxserve.cache.radix_cache import RadixCache

                prefix_cache = RadixCache(pool, make_event_recorder(index) if make_event_recorder else None)
            runner = ModelRunner(model, num_pages, page_size, self.buckets, self.max_model_len,
                                 config.attention_backend, mesh=mesh, num_penalty_slots=config.max_num_seqs,
                                 kv_dtype=self.kv_dtype, kv_scales=kv_scales,
                                 aux_layers=head[0].aux_layers(cfg.num_layers) if head is not None else ())
            drafter = None
            if head is not None:
                drafter = Eagle3Proposer(self._place_eagle3_head(head, model, dtype), pool, self.buckets,
                                         runner.max_seqs, dtype, config.attention_backend, mesh=mesh)
            if draft is not None:
                # The draft model on the replica's devices, with a pool of as many pages as the target's.
                draft_runner = ModelRunner(place(*draft, mesh), num_pages, page_size, self.buckets, self.max_model_len,
                                           config.attention_backend, mesh=mesh, num_penalty_slots=1)
                drafter = DraftModelProposer(draft_runner, PagePool(num_pages, page_size), self.buckets,
                                             config.max_num_batched_tokens, self.max_model_len)
            scheduler = Scheduler(
                pool, self.buckets, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, history_len=self.max_model_len,
                num_penalty_slots=runner.num_penalty_slots, prefix_cache=prefix_cache,
                policy=config.scheduling_policy, static=config.scheduler == "static",
                speculative=self.speculative, proposer=drafter,
                fit_drafts_to_bucket=mesh.devices.flat[0].platform == "cpu",
            )
            if isinstance(drafter, Eagle3Proposer):
                drafter.reserve = scheduler.reserve
            self.replicas.append(Replica(index, pool, prefix_cache, scheduler, runner, drafter))
        del params, draft
        # The replicas' KV-event recorders (empty when events are off: the per-step flush is then free).
        self._kv_recorders = [r.prefix_cache.events for r in self.replicas
                              if r.prefix_cache is not None and r.prefix_cache.events is not None]
        # Replica 0 under the single-replica names (what tests, metrics and scripts read).
        first = self.replicas[0]
        self.pool, self.prefix_cache, self.scheduler, self.runner = (first.pool, first.prefix_cache,
                                                                     first.scheduler, first.runner)
        self.load_seconds = time.perf_counter() - t0
        log.info("model %s (%s, %d layers), dtype %s, mesh %s, KV pool %d pages x %d tokens of %s = %.2f GiB per "
                 "replica, buckets T=%s P=%s", config.model or "default SmolLM2-135M-Instruct", cfg.architecture,
                 cfg.num_layers, config.dtype, config.mesh, num_pages, page_size, self.kv_dtype.name,
                 self.runner.kv_cache_bytes / 2**30, self.buckets.token_buckets, self.buckets.page_buckets)
        # Multi-host: every process runs this constructor; process 0 drives the others' steps.
        self.multihost = jax.process_count() > 1
        if self.multihost:
            from jaxserve import distributed

            if any(r.drafter is not None for r in self.replicas):  # followers replay the target's steps only
                raise ValueError(f"speculative method {self.speculative.method!r} does not run on several hosts yet")
            distributed.check_same_setup([r.runner for r in self.replicas], (config.mesh, config.dtype))
        if config.compile_ahead:
            for replica in self.replicas:
                replica.runner.warmup(show_progress)
                if isinstance(replica.drafter, Eagle3Proposer):
                    replica.drafter.warmup(self.buckets.all(), show_progress)
                elif replica.drafter is not None:
                    replica.drafter.runner.warmup(show_progress)
            if self.multihost:
                distributed.warm_up([r.runner for r in self.replicas])
            for replica in self.replicas:  # the guard counts from the end of the whole warm-up
                replica.runner.compiles_after_warmup_base = CompileCounter.count
            log.info("compiled %d step buckets in %.1f s", len(self.buckets.all()),
                     sum(r.runner.compile_seconds for r in self.replicas))
        self.broadcaster = None
        if self.multihost and jax.process_index() == 0:
            from jaxserve.distributed import StepBroadcaster

            self.broadcaster = StepBroadcaster(len(self.replicas))
        self._tracked: dict[str, _Tracked] = {}
        # Overlapped scheduling: step N+1 is planned and launched before step N's results are
        # read, so the host's work between steps runs while the device computes. Multi-host
        # followers replay plans one at a time, so a multi-host leader steps synchronously. So does
        # speculative decoding: the next step's drafts follow from what this one accepts.
        self.overlap = config.async_scheduling and not self.multihost and self.speculative is None
        for replica in self.replicas:
            replica.scheduler.defer_masks = self.overlap
        self._in_flight: list[_Launched] = []
        self.step_timings: deque = deque(maxlen=4096)  # (seqs, tokens, host s, schedule+device s)
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.eos_token_ids = tuple(cfg.eos_token_ids) or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        # Structured output: grammars compiled against our tokenizer (llguidance's, built on first use).
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids)

    def _page_size(self, config: EngineConfig, served_cfg: Any, tp: int) -> int:
        """config.page_size, raised where the TPU kernel needs larger pages (8-bit pools fill
        32-row sublane tiles: the default model's need 32 tokens a page), with a log line."""
        page_size = config.page_size
        if self.mesh.devices.flat[0].platform != "tpu" or resolve_backend(config.attention_backend) != "pallas":
            return page_size
        from jaxserve.pallas_kernels.ragged_paged_attention_tpu import min_page_size

        need = min_page_size(served_cfg.num_kv_heads // tp, served_cfg.head_dim, self.kv_dtype)
        if page_size % need:
            log.info("page_size %d -> %d: the TPU attention kernel's pages of %s KV must fill whole sublane tiles",
                     page_size, max(page_size, need), self.kv_dtype.name)
            page_size = max(page_size, need)
        return page_size

    def _calibrate_kv_scales(self, model: Any, page_size: int) -> KVScales:
        t0 = time.perf_counter()
        ids = list(self.tokenizer(CALIBRATION_TEXT, add_special_tokens=True).input_ids)[: self.max_model_len]
        scales = calibrate(model, ids, page_size, self.kv_dtype)
        log.info("KV cache %s: static scales per layer, head and channel, calibrated on %d tokens in %.1f s "
                 "(K scale %.3g..%.3g, V scale %.3g..%.3g)", self.kv_dtype.name, len(ids), time.perf_counter() - t0,
                 float(scales.k.min()), float(scales.k.max()), float(scales.v.min()), float(scales.v.max()))
        return scales

    def _load_draft_model(self, target_cfg: Any, tp: int, dtype: str) -> tuple[Any, Any, Any]:
        """(config, served config, weights) of the draft checkpoint, its heads laid out for the
        replica's tensor parallelism as the target's are."""
        from jaxserve import parallel
        from jaxserve.loading import load_weights

        path = self.speculative.model
        cfg, params = load_weights(path, dtype)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"speculative_config: the draft model {path} has a vocabulary of {cfg.vocab_size} "
                             f"tokens, the target {target_cfg.vocab_size}: they must share the tokenizer")
        parallel.check_splittable(cfg, tp)
        served, params = parallel.apply_head_layout(cfg, params, parallel.head_layout(cfg, tp))
        log.info("draft model %s (%s, %d layers)", path, cfg.architecture, cfg.num_layers)
        return cfg, served, params

    def _load_eagle3_head(self, target_cfg: Any) -> tuple[Any, dict, Any]:
        """(config, weights, draft-to-target ids) of the EAGLE-3 head, checked against the target."""
        from jaxserve.models.eagle3 import load_eagle3

        path = self.speculative.model
        cfg, params, d2t = load_eagle3(path)
        if cfg.vocab_size != target_cfg.vocab_size or cfg.target_hidden_size != target_cfg.hidden_size:
            raise ValueError(f"speculative_config: the EAGLE-3 head {path} is for a target with a vocabulary of "
                             f"{cfg.vocab_size} and hidden size {cfg.target_hidden_size}; this model has "
                             f"{target_cfg.vocab_size} and {target_cfg.hidden_size}")
        if "embed" not in params and cfg.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"speculative_config: the EAGLE-3 head {path} has no embedding of its own and a hidden "
                             f"size ({cfg.hidden_size}) other than the target's")
        log.info("EAGLE-3 head %s: draft vocabulary %d, reads target layers %s", path, cfg.draft_vocab_size,
                 cfg.aux_layers(target_cfg.num_layers))
        return cfg, params, d2t

    @staticmethod
    def _place_eagle3_head(head: tuple[Any, dict, Any], target: LlamaForCausalLM, dtype: Any) -> Any:
        """The head; without an embedding of its own it reads the target's (the proposer places
        the head, replicated, on the replica's devices)."""
        from jaxserve.models.eagle3 import Eagle3Head

        cfg, params, d2t = head
        if "embed" not in params:
            params = dict(params)
            if "embed_scale" in target.param_names:  # a quantized embedding: its rows, dequantized once
                from jaxserve.quantization import embed_rows

                offset = target.embed_offset[...] if "embed_offset" in target.param_names else None
                params["embed"] = embed_rows(target.embed[...], target.embed_scale[...], offset,
                                             jnp.arange(cfg.vocab_size), dtype)
            else:
                params["embed"] = target.embed[...]
        return Eagle3Head(cfg, params, d2t, dtype)

    @staticmethod
    def _kv_event_recorders(config: EngineConfig) -> Any:
        """A factory of each replica's KV-event recorder (with its own ZMQ publisher), or None."""
        from jaxserve.cache.kv_events import KVEventsConfig

        events = KVEventsConfig.parse(config.kv_events_config)
        if not events.active:
            return None
        if not config.enable_prefix_caching:
            log.warning("KV events need the prefix cache: none are published with prefix caching off")
            return None
        if jax.process_index() != 0:
            return None  # multi-host: the leader's scheduler owns the caches
        from jaxserve.cache.block_hash import BlockHasher
        from jaxserve.cache.kv_events import KVEventRecorder, ZmqEventPublisher

        hasher = BlockHasher(config.prefix_caching_hash_algo)
        return lambda rank: KVEventRecorder(hasher, ZmqEventPublisher(events, rank, hasher.external))

    def _flush_kv_events(self) -> None:
        """Once per step: each replica's events of the step become one published batch."""
        for recorder in self._kv_recorders:
            recorder.flush()

    def close(self) -> None:
        """Publish the last KV events and close their sockets (the server calls this at shutdown)."""
        self._flush_kv_events()
        for recorder in self._kv_recorders:
            if recorder.publisher is not None:
                recorder.publisher.close()
                recorder.publisher = None

    # ---- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0, seed_offset: int = 0, group_id: str | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    cumulative: bool = True) -> Request:
        """Validate and queue one sequence. (n > 1 is expanded by the callers into n requests.)
        `prompt_text`: the text a token-id `prompt` was tokenized from by the caller (front ends
        tokenize outside the engine lock), reported back as RequestOutput.prompt. `cumulative`:
        every output's outputs[0] holds the text, token ids and logprobs so far (else only the
        final one does, and the others carry just the deltas: what streaming front ends use)."""
        if request_id in self._tracked:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = _encode_prompt(self.tokenizer, prompt, self.model_config.vocab_size)
        text = text if prompt_text is None else prompt_text
        check_logit_bias_vocab(params, self.model_config.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, the context length is {self.max_model_len}")
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens {params.max_tokens} exceeds the {room} tokens left in the context "
                             f"({self.max_model_len}) after a {len(ids)}-token prompt")
        max_tokens = params.max_tokens or room
        capacity = (self.num_pages - 1) * self.pool.page_size
        if len(ids) + max_tokens > capacity:
            raise ValueError(f"request needs up to {len(ids) + max_tokens} tokens of KV cache, the page pool "
                             f"holds {capacity}; raise num_pages/kv_cache_memory or lower max_tokens")
        if sum(len(r.scheduler.waiting) for r in self.replicas) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        constraint = None
        if params.structured_outputs is not None:
            if self.multihost:  # followers would sample without the masks
                raise ValueError("structured_outputs is not supported on a multi-host mesh")
            constraint = self.grammars.constraint(params.structured_outputs)  # ValueError: it does not compile
        seed = params.seed + seed_offset if params.seed is not None else int(self._rng.integers(2**31))
        req = Request(request_id, ids, params, max_tokens, seed, self.eos_token_ids, priority, group_id=group_id,
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        req.constraint = constraint
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        replica = self._choose_replica(group_id, ids)
        self._tracked[request_id] = _Tracked(req, text, detok, replica, cumulative=cumulative)
        replica.scheduler.add(req)
        replica.num_requests += 1
        return req

    def _choose_replica(self, group_id: str | None, ids: Sequence[int]) -> Replica:
        """Data parallelism: the replica whose prefix cache holds the longest prefix of the prompt,
        unless it has BALANCE_SLACK more requests than the least loaded one; else (or with no
        hit) the least loaded. The n completions of one prompt stay together (shared pages)."""
        if len(self.replicas) == 1:
            return self.replicas[0]
        if group_id is not None:
            for t in self._tracked.values():
                if t.request.group_id == group_id:
                    return t.replica
        least = min(self.replicas, key=lambda r: r.load)
        hits = [r.prefix_cache.match_prefix(ids, max_tokens=len(ids) - 1, peek=True)[1]
                if r.prefix_cache is not None else 0 for r in self.replicas]
        best = max(range(len(self.replicas)), key=lambda i: (hits[i], -self.replicas[i].load))
        if hits[best] > 0 and self.replicas[best].load <= least.load + BALANCE_SLACK:
            return self.replicas[best]
        return least

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages now. Returns whether it was still live."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        tracked.replica.scheduler.finish(tracked.request, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self._in_flight) or any(r.scheduler.has_work() for r in self.replicas)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of every replica: all are dispatched before any is waited on, so the
        replicas' devices run at the same time. With overlap, the outputs returned are those of
        the step launched by the previous call: this call's step runs on the device meanwhile."""
        t0 = time.perf_counter()
        if self.multihost and self.broadcaster is None:
            # Followers released (or this is one): a step now would wait for them forever.
            raise RuntimeError("multi-host: this process does not drive the followers (stopped, or not process 0)")
        for replica in self.replicas:
            if replica.drafter is not None:  # the draft model's steps, before the target's is planned
                replica.drafter.prepare(replica.scheduler.draft_candidates())
        plans = [replica.scheduler.schedule() for replica in self.replicas]
        failed = [self._failed_output(req) for replica in self.replicas
                  for req in replica.scheduler.take_failed()]
        if all(plan is None for plan in plans) and not self._in_flight:
            self.keep_followers_alive()
            self._flush_kv_events()  # what aborts and failures evicted or cached meanwhile
            return failed
        if self.broadcaster is not None and any(plan is not None for plan in plans):
            self.broadcaster.send([r.runner for r in self.replicas], plans)  # the followers launch the same
        previous = {id(launch.replica): launch for launch in self._in_flight}
        launched = []
        for replica, plan in zip(self.replicas, plans):
            if plan is None:
                continue
            prev = previous.get(id(replica))
            out = replica.runner.launch(plan, prev.sampled_ids if prev is not None else None)
            launched.append(_Launched(replica, plan, out, replica.runner.last_sampled_ids,
                                      replica.runner.last_prompt_logprobs))
        t1 = time.perf_counter()
        if self.overlap:
            to_read, self._in_flight = self._in_flight, launched
        else:
            to_read = launched
        outputs = failed + self._read(to_read, launched, t0, t1)
        for x in launched:
            if x.plan.mask_deferred:
                # Structured output: the model step runs on the device while the previous step's
                # tokens advanced the matchers above; now the masks exist, and the sampler follows.
                mask = x.replica.scheduler.deferred_token_bitmask(x.plan)
                x.sampled = x.replica.runner.sample(x.sampled, mask)
                x.sampled_ids = x.replica.runner.last_sampled_ids
        self._flush_kv_events()
        return outputs

    def _read(self, to_read: list[_Launched], launched: list[_Launched] | None = None, t0: float = 0.0,
              t1: float = 0.0) -> list[RequestOutput]:
        """Wait for launched steps' results and collect them into outputs; with `launched` (this
        call's launches), record the step's host time against its whole time."""
        if self.multihost:  # a replica on other hosts' devices sends its outputs here
            from jaxserve.distributed import gather_outputs

            fetched = gather_outputs([x.replica.runner for x in to_read], [x.sampled for x in to_read])
            results = [(x, x.replica.runner.unpack(f)) for x, f in zip(to_read, fetched)]
        else:
            results = [(x, x.replica.runner.fetch(x.sampled, bool(x.plan.sampling["want_logprobs"].any())))
                       for x in to_read]
        if launched is not None:
            t2 = time.perf_counter()
            # Host time (scheduling + input preparation + dispatch) against the whole step.
            self.step_timings.append((sum(len(x.plan.seqs) for x in launched),
                                      sum(x.plan.num_tokens for x in launched), t1 - t0, t2 - t0))
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for x, (token_ids, logprobs) in results:
            prompt_lps = self._fetch_prompt_logprobs(x) if x.plan.wants_prompt_logprobs else None
            outputs += self._collect(x.replica, x.plan, token_ids, logprobs, prompt_lps, now)
            if isinstance(x.replica.drafter, Eagle3Proposer):  # the head reads the step's features now
                x.replica.drafter.observe(x.plan, x.replica.runner.last_aux)
        return outputs

    @staticmethod
    def _fetch_prompt_logprobs(launch: _Launched) -> Any:
        mesh = launch.replica.runner.mesh
        if mesh is not None and not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
            return None  # multi-host: a replica with no device here (prompt logprobs not gathered)
        return launch.replica.runner.fetch_prompt_logprobs(launch.prompt_logprobs)

    def _collect(self, replica: Replica, plan: Any, token_ids: np.ndarray, logprobs: Any, prompt_lps: Any,
                 now: float) -> list[RequestOutput]:
        outputs = []
        seen: set[int] = set()
        for req, _ in replica.scheduler.update(plan, token_ids, logprobs, prompt_lps):
            if id(req) in seen:  # several tokens (accepted drafts): one output for all of them
                continue
            seen.add(id(req))
            if req.first_token_time is None:
                req.first_token_time = now
            tracked = self._tracked.get(req.request_id)
            if tracked is None:
                continue
            try:
                outputs.append(self._advance(tracked))
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer failing on this request's text
                log.exception("request %s failed after a step", req.request_id)
                req.error = f"the request failed after a step: {type(exc).__name__}: {exc}"
                replica.scheduler.finish(req, "abort")
                outputs.append(self._failed_output(req))
        return outputs

    def _failed_output(self, req: Request) -> RequestOutput:
        """The final output of a request the engine failed alone (already finished, pages freed)."""
        t = self._tracked.pop(req.request_id, None)
        completion = CompletionOutput(0, t.text if t else "", list(req.output_token_ids), "abort")
        queued = None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time
        return RequestOutput(req.request_id, t.prompt if t else None, req.prompt_token_ids, [completion], True,
                             req.num_cached_tokens, queue_seconds=queued, error=req.error)

    def _advance(self, t: _Tracked) -> RequestOutput:
        req = t.request
        p = req.params
        finished = req.is_finished
        text = t.detok.text
        # Token by token, as without speculation: a stop string completed by an accepted draft
        # ends the output at that token, and the tokens after it are dropped.
        while t.pushed_tokens < len(req.output_token_ids):
            t.detok.push(req.output_token_ids[t.pushed_tokens])
            t.pushed_tokens += 1
            text = t.detok.text
            if p.stop_strings:
                start = max(0, t.emitted_chars - max(len(s) for s in p.stop_strings))
                hits = [(text.find(s, start), s) for s in p.stop_strings]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    idx, s = min(hits)
                    text = text[:idx]
                    if t.pushed_tokens < len(req.output_token_ids):
                        del req.output_token_ids[t.pushed_tokens:]
                        del req.output_logprobs[t.pushed_tokens:]
                        finished = False  # a later token's stop (EOS, length) no longer counts
                    if not finished:
                        req.finish_reason, req.stop_reason = "stop", s
                        t.replica.scheduler.finish(req, "stop")
                    finished = True
                    break
        if finished:
            visible = len(text)
        else:
            # Hold back what could still become the start of a stop string.
            hold = max((len(s) - 1 for s in p.stop_strings), default=0)
            visible = max(t.emitted_chars, len(text) - hold)
        delta_text = text[t.emitted_chars: visible]
        t.emitted_chars = visible
        t.text = text[:visible]
        delta_ids = req.output_token_ids[t.emitted_tokens:]
        t.emitted_tokens = len(req.output_token_ids)
        if finished:
            self._tracked.pop(req.request_id, None)
        logprobs = delta_logprobs = None
        whole = finished or t.cumulative  # copies that grow with the output: only when asked for
        if p.logprobs is not None:
            # Only the new tokens' dicts are built; the list handed out is a shallow copy.
            done = len(t.logprob_dicts)
            delta_logprobs = [{tok: lp, **dict(zip(ids, lps))} for tok, (lp, ids, lps)
                              in zip(req.output_token_ids[done:], req.output_logprobs[done:])]
            t.logprob_dicts += delta_logprobs
            logprobs = list(t.logprob_dicts) if whole else None
        completion = CompletionOutput(0, t.text if whole else "", list(req.output_token_ids) if whole else [],
                                      req.finish_reason if finished else None, req.stop_reason, logprobs)
        queued = None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time
        prompt_lps = None
        if req.prompt_logprobs is not None and not t.sent_prompt_logprobs:
            prompt_lps, t.sent_prompt_logprobs = list(req.prompt_logprobs), True
        return RequestOutput(req.request_id, t.prompt, req.prompt_token_ids, [completion], finished,
                             req.num_cached_tokens, delta_text, delta_ids, queued, prompt_logprobs=prompt_lps,
                             error=req.error if finished else None, delta_logprobs=delta_logprobs)

    def discard_in_flight(self) -> None:
        """Forget launched steps unread: only after every request in them was aborted (shutdown,
        or a failed step), when nothing is left to deliver their tokens to."""
        for launch in self._in_flight:
            for s in launch.plan.seqs:
                s.request.num_pending -= s.sample
        self._in_flight = []

    def keep_followers_alive(self) -> None:
        """Multi-host, while idle: let the followers' pending collective complete before it times out."""
        if self.broadcaster is not None:
            self.broadcaster.keep_alive()

    def stop_followers(self) -> None:
        """Multi-host: release the other processes from their follow() loops."""
        if self.broadcaster is not None:
            self.broadcaster.stop()
            self.broadcaster = None

    # ---- introspection ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Page pool and prefix cache consistency (tests call this after every scenario)."""
        for r in self.replicas:
            external = None
            if r.prefix_cache is not None:
                r.prefix_cache.check_invariants()
                external = r.prefix_cache.external_refs()
            r.pool.check_invariants(external)
            r.scheduler.check_invariants()
            if r.drafter is not None:
                r.drafter.check_invariants()

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        """Speculative decoding totals of all replicas (zeros with speculation off)."""
        total = SpecDecodeStats()
        for r in self.replicas:
            total = total.merged(r.scheduler.spec_stats)
        return total

    @property
    def compiles_after_warmup(self) -> int:
        return max(r.runner.compiles_after_warmup for r in self.replicas)  # a process-wide count

    @property
    def num_running(self) -> int:
        return sum(len(r.scheduler.running) for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(len(r.scheduler.waiting) for r in self.replicas)

    @property
    def num_used_pages(self) -> int:
        return sum(r.pool.num_pages - 1 - r.pool.num_free for r in self.replicas)


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""
