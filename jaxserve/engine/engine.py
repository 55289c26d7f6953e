"""LLMEngine: the synchronous core that owns the model, the page pool, the scheduler and the runner.

`step()` runs one scheduled batch on the device and returns what each request gained. The offline
LLM API drives it in a loop; the AsyncEngine drives it from its own thread.
"""

from __future__ import annotations

import itertools
from collections import deque
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from jaxserve.cache.page_pool import PagePool
from jaxserve.config import EngineConfig
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.runner import ModelRunner, enable_compilation_cache
from jaxserve.engine.scheduler import Scheduler
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


@dataclass
class _Tracked:
    """Engine-side state of one request: detokenization and stop strings."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    emitted_chars: int = 0
    emitted_tokens: int = 0
    text: str = ""


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


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        from jaxserve.loading import load_tokenizer, load_weights, resolve_dtype
        from jaxserve.models.llama import LlamaForCausalLM

        self.config = config
        enable_compilation_cache(config.compilation_cache_dir)
        t0 = time.perf_counter()
        cfg, params = load_weights(config.model, config.dtype)
        self.model_config = cfg
        self.tokenizer = load_tokenizer(config.model)
        model = LlamaForCausalLM(cfg, resolve_dtype(config.dtype))
        model.load_params(params)
        del params
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        page_size = config.page_size
        dtype_bytes = np.dtype(resolve_dtype(config.dtype)).itemsize
        bytes_per_page = cfg.kv_bytes_per_token // 4 * dtype_bytes * page_size
        num_pages = config.num_pages or max(2, int(config.kv_cache_memory * 2**30 // bytes_per_page))
        self.num_pages = num_pages
        max_pages_per_seq = -(-self.max_model_len // page_size)
        self.buckets = Buckets.create(config.max_num_batched_tokens, config.max_num_seqs, max_pages_per_seq)
        self.pool = PagePool(num_pages, page_size)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            from jaxserve.cache.radix_cache import RadixCache

            self.prefix_cache = RadixCache(self.pool)
        self.scheduler = Scheduler(
            self.pool, self.buckets, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, history_len=self.max_model_len,
            prefix_cache=self.prefix_cache, policy=config.scheduling_policy, static=config.scheduler == "static",
        )
        self.runner = ModelRunner(model, num_pages, page_size, self.buckets, self.max_model_len,
                                  config.attention_backend)
        self.load_seconds = time.perf_counter() - t0
        log.info("model %s (%s, %d layers), dtype %s, KV pool %d pages x %d tokens = %.2f GiB, buckets T=%s P=%s",
                 config.model or "default SmolLM2-135M-Instruct", cfg.architecture, cfg.num_layers, config.dtype,
                 num_pages, page_size, self.runner.kv_cache_bytes / 2**30, self.buckets.token_buckets,
                 self.buckets.page_buckets)
        if config.compile_ahead:
            self.runner.warmup(show_progress)
            log.info("compiled %d step buckets in %.1f s", len(self.buckets.all()), self.runner.compile_seconds)
        self._tracked: dict[str, _Tracked] = {}
        self.step_timings: deque = deque(maxlen=4096)  # (seqs, tokens, host s, schedule+device s)
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.eos_token_ids = tuple(cfg.eos_token_ids) or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())

    # ---- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0, seed_offset: int = 0, group_id: str | None = None) -> Request:
        """Validate and queue one sequence. (n > 1 is expanded by the callers into n requests.)"""
        if request_id in self._tracked:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = _encode_prompt(self.tokenizer, prompt, self.model_config.vocab_size)
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
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        seed = params.seed + seed_offset if params.seed is not None else int(self._rng.integers(2**31))
        req = Request(request_id, ids, params, max_tokens, seed, self.eos_token_ids, priority, group_id=group_id)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self._tracked[request_id] = _Tracked(req, text, detok)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages now. Returns whether it was still live."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        self.scheduler.finish(tracked.request, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        t1 = time.perf_counter()
        token_ids, logprobs = self.runner.execute(plan)
        t2 = time.perf_counter()
        # Host time (scheduling + input preparation) against the whole step, per batch size.
        self.step_timings.append((len(plan.seqs), plan.num_tokens, t1 - t0, t2 - t0))
        now = time.monotonic()
        outputs = []
        for req, _ in self.scheduler.update(plan, token_ids, logprobs):
            if req.first_token_time is None:
                req.first_token_time = now
            tracked = self._tracked.get(req.request_id)
            if tracked is None:
                continue
            outputs.append(self._advance(tracked))
        return outputs

    def _advance(self, t: _Tracked) -> RequestOutput:
        req = t.request
        p = req.params
        t.detok.push(req.output_token_ids[-1])
        text = t.detok.text
        finished = req.is_finished
        if p.stop_strings:
            start = max(0, t.emitted_chars - max(len(s) for s in p.stop_strings))
            hits = [(text.find(s, start), s) for s in p.stop_strings]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, s = min(hits)
                text = text[:idx]
                if not finished:
                    req.finish_reason, req.stop_reason = "stop", s
                    self.scheduler.finish(req, "stop")
                finished = True
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
        logprobs = None
        if p.logprobs is not None:
            logprobs = [{tok: lp, **dict(zip(ids, lps))} for tok, (lp, ids, lps)
                        in zip(req.output_token_ids, req.output_logprobs)]
        completion = CompletionOutput(0, t.text, list(req.output_token_ids),
                                      req.finish_reason if finished else None, req.stop_reason, logprobs)
        return RequestOutput(req.request_id, t.prompt, req.prompt_token_ids, [completion], finished,
                             req.num_cached_tokens, delta_text, delta_ids)

    # ---- introspection ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Page pool and prefix cache consistency (tests call this after every scenario)."""
        external = None
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
            external = self.prefix_cache.external_refs()
        self.pool.check_invariants(external)

    @property
    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""
