"""Prometheus metrics: our own `jaxserve:` family, and the same measurements under vLLM's names.

Routers and gateways that balance vLLM replicas (vllm-router, the Gateway API inference
extension, dashboards built for vLLM) read `vllm:` series by name, with a `model_name` label:
exposing them lets jaxserve replicas join such a fleet unchanged. Both families are fed by the
same observations; gauges and engine-side counters are read from the engine at scrape time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from jaxserve.engine.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class VllmMetrics:
    """vLLM's V1 metric names and labels. prometheus_client appends `_total` to counters in the
    exposition (`vllm:prompt_tokens_total`), as in vLLM itself, which builds them the same way.
    Labels: `model_name` (the served name) and `engine` (vLLM's engine index; one engine here,
    data-parallel replicas included, so always "0")."""

    LABELS = ("model_name", "engine")

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, names = registry, self.LABELS
        self.label_values = {"model_name": model_name, "engine": "0"}
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", names, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", names, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = all pages held by requests",
                              names, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix-cache queries, in prompt tokens queried",
                                      names, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens found cached",
                                   names, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (recomputed later)", names, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", names, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", names, registry=r)
        self.requests = Counter("vllm:request_success", "Finished requests", names + ("finished_reason",), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", names,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", names,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency", names,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling", names,
                               buckets=_LATENCY_BUCKETS, registry=r)
        # vLLM's info-style gauge: value 1, the configuration in the labels (the inference
        # extension reads block_size and num_gpu_blocks from it). Set once the engine exists.
        self.cache_config = Gauge("vllm:cache_config_info", "KV-cache configuration (labels), value 1",
                                  ["model_name", "engine", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                                   "enable_prefix_caching", "cache_dtype"], registry=r)
        self._cache_config_set = False
        # Speculative decoding (vLLM V1's names): verified sequences with drafts, draft tokens,
        # accepted ones, and accepted ones per draft position.
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Sequences verified with draft tokens",
                                   names, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", names,
                                         registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", names,
                                     registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, per draft position", names + ("position",),
                                             registry=r)
        self._spec_seen = (0, 0, 0, [])
        # Every series exists from the first scrape (at 0), as vLLM's do: consumers find them before traffic.
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                       self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.queue):
            metric.labels(**self.label_values)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(**self.label_values, finished_reason=reason)

    def of(self, metric: Any) -> Any:
        """The series of `metric` for this server (its label values)."""
        return metric.labels(**self.label_values)

    def count_spec_decode(self, stats: Any) -> None:
        """Advance the spec-decode counters to the engine's running totals (a SpecDecodeStats)."""
        drafts, tokens, accepted, per_pos = self._spec_seen
        if stats.num_drafts < drafts:
            return  # (never: the totals only grow)
        self.of(self.spec_drafts).inc(stats.num_drafts - drafts)
        self.of(self.spec_draft_tokens).inc(stats.num_draft_tokens - tokens)
        self.of(self.spec_accepted).inc(stats.num_accepted_tokens - accepted)
        for pos, count in enumerate(stats.accepted_per_pos):
            seen = per_pos[pos] if pos < len(per_pos) else 0
            self.spec_accepted_per_pos.labels(**self.label_values, position=str(pos)).inc(count - seen)
        self._spec_seen = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                           list(stats.accepted_per_pos))

    def set_cache_config(self, config: Any, num_pages: int, page_size: int, cache_dtype: str) -> None:
        """num_pages: the usable KV pages of all replicas (the null page excluded); cache_dtype
        is the pool's dtype (vLLM's label: "auto" there means the model's)."""
        if self._cache_config_set:
            return
        self._cache_config_set = True
        self.cache_config.labels(
            **self.label_values, block_size=str(page_size), num_gpu_blocks=str(num_pages), num_cpu_blocks="0",
            enable_prefix_caching=str(bool(config.enable_prefix_caching)), cache_dtype=cache_dtype).set(1)


class Metrics:
    def __init__(self, model_name: str = "jaxserve") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("jaxserve:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("jaxserve:num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_pages_used = Gauge("jaxserve:kv_cache_pages_used", "KV pages owned by requests or the prefix cache", registry=r)
        self.kv_usage = Gauge("jaxserve:kv_cache_usage_perc",
                              "Fraction of KV pages held by requests (evictable prefix-cache pages count as free)",
                              registry=r)
        self.kv_pages_evictable = Gauge("jaxserve:kv_cache_pages_evictable",
                                        "Prefix-cache pages no request holds (reclaimable)", registry=r)
        self.preemptions = Counter("jaxserve:num_preemptions", "Requests preempted (recomputed later)", registry=r)
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)  # (query tokens, hit tokens) already counted into the vllm: counters
        self.prefix_hit_rate = Gauge("jaxserve:prefix_cache_hit_rate", "Prefix-cache hit tokens / query tokens", registry=r)
        self.compiles = Gauge("jaxserve:compile_count_after_warmup", "XLA compilations since warm-up", registry=r)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("jaxserve:request_success", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve:inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds", "End-to-end latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("jaxserve:request_queue_time_seconds", "Time from arrival to first scheduling",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm = VllmMetrics(r, model_name)

    def render(self, engine: "AsyncEngine | None") -> bytes:
        if engine is not None:
            self._read_engine(engine)
        return generate_latest(self.registry)

    def _read_engine(self, engine: "AsyncEngine") -> None:
        e, v = engine.engine, self.vllm
        self.running.set(e.num_running)
        v.of(v.running).set(e.num_running)
        self.waiting.set(e.num_waiting)
        v.of(v.waiting).set(e.num_waiting)
        used = e.num_used_pages
        self.kv_pages_used.set(used)
        caches = [r.prefix_cache for r in e.replicas if r.prefix_cache is not None]
        try:  # read while the engine thread runs: a tree changing under the walk is retried next scrape
            evictable = sum(c.evictable_pages() for c in caches)
        except RuntimeError:
            evictable = 0
        self.kv_pages_evictable.set(evictable)
        usage = max(0, used - evictable) / max(1, (e.num_pages - 1) * len(e.replicas))
        self.kv_usage.set(usage)
        v.of(v.kv_usage).set(usage)
        total = sum(getattr(r.scheduler, "num_preemptions", 0) for r in e.replicas)
        if total > self._preemptions_seen:
            self.preemptions.inc(total - self._preemptions_seen)
            v.of(v.preemptions).inc(total - self._preemptions_seen)
            self._preemptions_seen = total
        if caches:
            self.prefix_hit_rate.set(sum(c.hit_rate for c in caches) / len(caches))
            # The radix caches keep running totals (written by the engine thread; plain ints, so a
            # racy read is at worst one request behind): the counters advance by the difference.
            queried, hit = sum(c.query_tokens for c in caches), sum(c.hit_tokens for c in caches)
            seen_q, seen_h = self._prefix_seen
            if queried >= seen_q and hit >= seen_h:
                v.of(v.prefix_queries).inc(queried - seen_q)
                v.of(v.prefix_hits).inc(hit - seen_h)
                self._prefix_seen = (queried, hit)
        self.compiles.set(e.compiles_after_warmup)
        if getattr(e, "speculative", None) is not None:
            v.count_spec_decode(e.spec_decode_stats)
        v.set_cache_config(e.config, (e.num_pages - 1) * len(e.replicas), e.pool.page_size, e.kv_dtype.name)

    # ---- per-request observations, recorded under both families --------------------------------
    def observe_queue(self, seconds: float) -> None:
        self.queue.observe(seconds)
        self.vllm.of(self.vllm.queue).observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm.of(self.vllm.ttft).observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.of(self.vllm.itl).observe(seconds)

    def count_generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)
        self.vllm.of(self.vllm.generation_tokens).inc(tokens)

    def count_finished(self, reason: str, prompt_tokens: int, seconds: float) -> None:
        self.e2e.observe(seconds)
        self.vllm.of(self.vllm.e2e).observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm.of(self.vllm.prompt_tokens).inc(prompt_tokens)
        self.requests.labels(finish_reason=reason).inc()
        self.vllm.requests.labels(**self.vllm.label_values, finished_reason=reason).inc()


class RequestTimer:
    """Per-request latency bookkeeping, fed by each streamed output."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.queued = False

    def on_scheduled(self, queue_seconds: float | None) -> None:
        """Queue time, once per request, from its first output (so requests aborted later count too)."""
        if queue_seconds is not None and not self.queued:
            self.queued = True
            self.metrics.observe_queue(queue_seconds)

    def on_tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.observe_ttft(now - self.start)
        else:
            self.metrics.observe_itl((now - self.last) / count)
        self.last = now
        self.metrics.count_generated(count)

    def on_finish(self, reason: str | None, prompt_tokens: int) -> None:
        self.metrics.count_finished(reason or "abort", prompt_tokens, time.monotonic() - self.start)
