"""Prometheus metrics, named like vLLM's under the `jaxserve:` prefix."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from jaxserve.engine.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class Metrics:
    def __init__(self) -> None:
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

    def render(self, engine: "AsyncEngine | None") -> bytes:
        if engine is not None:
            e = engine.engine
            self.running.set(e.num_running)
            self.waiting.set(e.num_waiting)
            used = e.num_used_pages
            self.kv_pages_used.set(used)
            caches = [r.prefix_cache for r in e.replicas if r.prefix_cache is not None]
            try:  # read while the engine thread runs: a tree changing under the walk is retried next scrape
                evictable = sum(c.evictable_pages() for c in caches)
            except RuntimeError:
                evictable = 0
            self.kv_pages_evictable.set(evictable)
            self.kv_usage.set(max(0, used - evictable) / max(1, (e.num_pages - 1) * len(e.replicas)))
            total = sum(getattr(r.scheduler, "num_preemptions", 0) for r in e.replicas)
            if total > self._preemptions_seen:
                self.preemptions.inc(total - self._preemptions_seen)
                self._preemptions_seen = total
            if caches:
                self.prefix_hit_rate.set(sum(c.hit_rate for c in caches) / len(caches))
            self.compiles.set(e.compiles_after_warmup)
        return generate_latest(self.registry)


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
            self.metrics.queue.observe(queue_seconds)

    def on_tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe((now - self.last) / count)
        self.last = now
        self.metrics.generation_tokens.inc(count)

    def on_finish(self, reason: str | None, prompt_tokens: int) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.requests.labels(finish_reason=reason or "abort").inc()
