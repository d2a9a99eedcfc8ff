"""Prometheus metrics (prefix `poolserve_`, fixed buckets); one registry per app, no globals.

With several processes (front ends and the engine core) prometheus-client's multiprocess mode
is on (`PROMETHEUS_MULTIPROC_DIR`, set by the process supervisor before any child starts):
each process writes its counters and histograms to files there, and any front end's /metrics
sums them; the engine's gauges come from the core itself, asked at scrape time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from poolserve.scheduler.stats import EngineSnapshot

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's switch to multiprocess mode
REJECT_REASONS = ("queue_full", "tokens_full", "tokenizing_full", "draining", "not_ready")


class ServiceMetrics:
    """All metrics of one server; also the engine's observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "poolserve_requests",
            "HTTP requests by endpoint, task and status.",
            ["endpoint", "task", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "poolserve_request_duration_seconds",
            "HTTP request latency.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenization = Histogram(
            "poolserve_tokenization_duration_seconds",
            "Tokenization time per HTTP request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "poolserve_queue_duration_seconds",
            "Time an input waited before its first step.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "poolserve_inference_duration_seconds",
            "Time from an input's first step to its output.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "poolserve_prompt_tokens", "Prompt tokens admitted.", registry=r
        )
        self.output_bytes = Counter(
            "poolserve_output_bytes", "Response body bytes of inference routes.", registry=r
        )
        self.step_duration = Histogram(
            "poolserve_step_duration_seconds",
            "Forward + pooling time of one step.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "poolserve_rejected_requests",
            "Requests refused before any work, by reason.",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)

        self._engine: _EngineCollector | None = None

    def bind_engine(
        self, snapshot: Callable[[], EngineSnapshot | None], ready: Callable[[], bool]
    ) -> None:
        """Export the engine's gauges and counters, read at scrape time (None: unknown now)."""
        self._engine = _EngineCollector(snapshot, ready)
        self.registry.register(self._engine)

    def render(self) -> bytes:
        """The text exposition format: this process's metrics, or every process's."""
        directory = os.environ.get(MULTIPROCESS_DIR)
        if not directory:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, directory)
        if self._engine is not None:
            registry.register(self._engine)
        return generate_latest(registry)

    # EngineObserver
    def on_step(self, num_tokens: int, duration_s: float) -> None:
        """Record one step."""
        self.step_duration.observe(duration_s)

    def on_request_done(self, queue_time_s: float, inference_time_s: float) -> None:
        """Record one finished input."""
        self.queue.observe(queue_time_s)
        self.inference.observe(inference_time_s)

    def on_reject(self, reason: str) -> None:
        """Record one refusal."""
        self.rejected.labels(reason).inc()


class _EngineCollector(Collector):
    """Reads an engine snapshot on every scrape."""

    def __init__(
        self, snapshot: Callable[[], EngineSnapshot | None], ready: Callable[[], bool]
    ) -> None:
        self.snapshot = snapshot
        self.ready = ready

    def collect(self) -> Iterator[Metric]:
        """Yield the engine's metric families."""
        yield GaugeMetricFamily(
            "poolserve_ready", "1 when the server accepts work, else 0.", value=int(self.ready())
        )
        s = self.snapshot()
        if s is None:
            return  # the engine core did not answer: its families are left out, not zeroed
        gauges = {
            "poolserve_running_requests": ("Inputs in a step right now.", s.num_running),
            "poolserve_waiting_requests": ("Inputs waiting for their first step.", s.num_waiting),
            "poolserve_queued_tokens": (
                "Prompt tokens of queued and running inputs.",
                s.num_queued_tokens,
            ),
            "poolserve_kv_blocks_used": (
                "KV cache blocks held by running prompts (chunked, or storing prefix blocks).",
                s.num_kv_blocks_used,
            ),
            "poolserve_kv_blocks_capacity": ("KV cache blocks in all.", s.num_kv_blocks_total),
            "poolserve_kv_blocks_cached": (
                "Free KV cache blocks still holding a cached prefix (reused on a hit).",
                s.num_kv_blocks_cached,
            ),
            "poolserve_open_poolers": (
                "Pooling states of requests not yet finished or released; zero at idle.",
                s.num_open_poolers,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "poolserve_step_tokens": ("Tokens run through the model.", s.step_tokens_total),
            "poolserve_cloned_bytes": (
                "Bytes cloned to own pooled outputs under async scheduling.",
                s.cloned_bytes_total,
            ),
            "poolserve_prefix_cache_hit_tokens": (
                "Prompt tokens of last-token requests found in the prefix cache (not computed).",
                s.prefix_cache_hit_tokens,
            ),
            "poolserve_prefix_cache_miss_tokens": (
                "Prompt tokens of last-token requests not found in the prefix cache (computed).",
                s.prefix_cache_miss_tokens,
            ),
            "poolserve_prefix_cache_evictions": (
                "Cached KV blocks reused for other prompts, least recently freed first.",
                s.prefix_cache_evictions,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
