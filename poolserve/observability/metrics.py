"""Prometheus metrics (prefix `poolserve_`, fixed buckets); one registry per app, no globals.

With several processes (front ends and the engine core) prometheus-client's multiprocess mode
is on (`PROMETHEUS_MULTIPROC_DIR`, set by the process supervisor before any child starts):
each process writes its counters and histograms to files there, and any front end's /metrics
sums them; the engine's gauges come from the core itself, asked at scrape time. Every series
carries `model_name` (the model's served name, as vLLM labels its series): a server of several
models exports one series per model. A request through a LoRA adapter counts under its base
model, as vLLM counts it; the metrics of each request also carry `lora_name` (its adapter, ""
for none). A request's count and latency also carry `protocol`, the transport it came by
(`http` or `grpc`: two values, so the label at most doubles those two series).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from poolserve.types.process import MULTIPROCESS_DIR
from poolserve.types.stats import EngineSnapshot, LoraStats

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
REJECT_REASONS = ("queue_full", "tokens_full", "tokenizing_full", "draining", "not_ready")
# Every series carries the served name of its model under this label, as vLLM's do.
MODEL_LABEL = "model_name"
# The label's value on what reached no model (probes, a refusal before routing, unknown names).
UNROUTED = ""
# The metrics of each request also name the LoRA adapter it ran through under this label...
LORA_LABEL = "lora_name"
# ...with this value for a request of the model itself (and one that reached no model).
NO_LORA = ""
# The API key series (--api-keys-file) name the key by its name under this label.
KEY_LABEL = "key"
# A request's count and latency name the transport it came by under this label, one of
# PROTOCOLS: the HTTP edge's and the gRPC server's calls share one pipeline and one series.
PROTOCOL_LABEL = "protocol"
HTTP = "http"
GRPC = "grpc"
PROTOCOLS = (HTTP, GRPC)


def fix_process_identity() -> None:
    """Name this process's metric files once, for the process's life (before any metric).

    prometheus-client's multiprocess values ask the kernel for the pid on every inc and
    observe, to notice a fork; a front end makes 14 such calls a request. Server processes are
    started, never forked, so their pid is read once here (the value class's own parameter).
    """
    if os.environ.get(MULTIPROCESS_DIR):
        pid = os.getpid()
        values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)


class ServiceMetrics:
    """All metrics of one server; each model's children (and engine observer) from `model`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = MODEL_LABEL
        lora = LORA_LABEL
        self.requests = Counter(
            "poolserve_requests",
            "Requests by model, LoRA adapter, protocol, endpoint, task and (HTTP) status.",
            [m, lora, PROTOCOL_LABEL, "endpoint", "task", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "poolserve_request_duration_seconds",
            "Request latency.",
            [m, lora, PROTOCOL_LABEL, "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenization = Histogram(
            "poolserve_tokenization_duration_seconds",
            "Tokenization time per HTTP request.",
            [m, lora],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "poolserve_queue_duration_seconds",
            "Time an input waited before its first step.",
            [m],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "poolserve_inference_duration_seconds",
            "Time from an input's first step to its output.",
            [m],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "poolserve_prompt_tokens", "Prompt tokens admitted.", [m, lora], registry=r
        )
        self.output_bytes = Counter(
            "poolserve_output_bytes",
            "Response body bytes of inference routes.",
            [m, lora],
            registry=r,
        )
        self.step_duration = Histogram(
            "poolserve_step_duration_seconds",
            "Forward + pooling time of one step.",
            [m],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "poolserve_rejected_requests",
            "Requests refused before any work, by model and reason.",
            [m, "reason"],
            registry=r,
        )
        # --api-keys-file: each key's usage under its name (never the key itself)
        self.key_requests = Counter(
            "poolserve_api_key_requests",
            "Requests made with each API key, by the key's name (whatever their answer).",
            [KEY_LABEL],
            registry=r,
        )
        self.key_prompt_tokens = Counter(
            "poolserve_api_key_prompt_tokens",
            "Prompt tokens admitted for each API key, by the key's name.",
            [KEY_LABEL],
            registry=r,
        )
        self.key_rejected = Counter(
            "poolserve_api_key_rejected_requests",
            "Requests of each API key refused by its limits, models or routes, by reason.",
            [KEY_LABEL, "reason"],
            registry=r,
        )
        # --batch-dir: the Batch API's lines and batches (counted by the front end running them)
        self.batch_lines = Counter(
            "poolserve_batch_lines",
            "Batch API lines written, by outcome: completed (2xx) or failed (error lines, "
            "batch_expired included).",
            ["outcome"],
            registry=r,
        )
        self.batches_ended = Counter(
            "poolserve_batches_ended",
            "Batch API batches ended, by status: completed, failed, expired or cancelled.",
            ["status"],
            registry=r,
        )
        self._models: dict[str, ModelMetrics] = {}
        self._engine: _EngineCollector | None = None
        # each transport's finished requests, counted through children made once
        self.transports = {protocol: Transport(self, protocol) for protocol in PROTOCOLS}

    def model(self, name: str) -> ModelMetrics:
        """The named model's children, made once (its every reason counted from zero)."""
        metrics = self._models.get(name)
        if metrics is None:
            metrics = self._models[name] = ModelMetrics(self, name)
        return metrics

    def add_output_bytes(self, model_name: str, lora_name: str, num_bytes: int) -> None:
        """Count an answer's body bytes for the model (and LoRA adapter) it came from."""
        known = self._models.get(model_name)
        if known is None:
            self.output_bytes.labels(model_name, lora_name).inc(num_bytes)
        else:
            known.through(lora_name).output_bytes.inc(num_bytes)

    def on_reject(self, reason: str, model_name: str = UNROUTED) -> None:
        """Record one refusal (of a request that reached no model: `model_name` empty)."""
        self.rejected.labels(model_name, reason).inc()

    def bind_engines(
        self,
        snapshots: Mapping[str, Callable[[], EngineSnapshot | None]],
        ready: Callable[[], bool],
    ) -> None:
        """Export each model's engine gauges and counters, read at scrape time (None: unknown
        now), labelled by its served name."""
        self._engine = _EngineCollector(dict(snapshots), ready)
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


class Transport:
    """One protocol's request count and latency: children looked up once per label set.

    `.labels(...)` validates and hashes its values under a lock on every call (~4 us for the
    two metrics); a request of a label set seen before pays two dictionary lookups.
    """

    def __init__(self, metrics: ServiceMetrics, protocol: str) -> None:
        self.protocol = protocol
        self._requests = metrics.requests
        self._duration = metrics.request_duration
        self._children: dict[tuple[str, str, str, str, int], tuple[Counter, Histogram]] = {}

    def add(
        self, model: str, lora: str, endpoint: str, task: str, status: int, seconds: float
    ) -> None:
        """Count one finished request and observe its duration."""
        key = (model, lora, endpoint, task, status)
        children = self._children.get(key)
        if children is None:
            # bounded: models (and their loaded adapters) x endpoints x tasks x statuses is
            # small (a model is a served one, an adapter a loaded one; HTTP's unmatched paths
            # share one endpoint, gRPC answers an unknown method before any handler runs)
            children = self._children[key] = (
                self._requests.labels(model, lora, self.protocol, endpoint, task, str(status)),
                self._duration.labels(model, lora, self.protocol, endpoint),
            )
        children[0].inc()
        children[1].observe(seconds)


class RequestMetrics:
    """The children a request moves: of one model, run as it is or through one LoRA adapter.

    `.labels(...)` validates and hashes its values under a lock on every call: each child is
    looked up once here, not per request.
    """

    def __init__(self, metrics: ServiceMetrics, model_name: str, lora_name: str) -> None:
        self.tokenization = metrics.tokenization.labels(model_name, lora_name)
        self.prompt_tokens = metrics.prompt_tokens.labels(model_name, lora_name)
        self.output_bytes = metrics.output_bytes.labels(model_name, lora_name)


class ModelMetrics(RequestMetrics):
    """One model's children of the service's metrics (its own requests': no adapter); also that
    model's engine observer."""

    def __init__(self, metrics: ServiceMetrics, name: str) -> None:
        super().__init__(metrics, name, NO_LORA)
        self.name = name
        self._metrics = metrics
        self._adapters: dict[str, RequestMetrics] = {}
        self.queue = metrics.queue.labels(name)
        self.inference = metrics.inference.labels(name)
        self.step_duration = metrics.step_duration.labels(name)
        self._rejected = metrics.rejected
        self._reasons = {reason: metrics.rejected.labels(name, reason) for reason in REJECT_REASONS}

    def through(self, lora_name: str | None) -> RequestMetrics:
        """The children of the model's requests through LoRA adapter `lora_name` (made once;
        None or NO_LORA: the model's own)."""
        if lora_name is None or lora_name == NO_LORA:
            return self
        children = self._adapters.get(lora_name)
        if children is None:
            children = self._adapters[lora_name] = RequestMetrics(
                self._metrics, self.name, lora_name
            )
        return children

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
        child = self._reasons.get(reason)
        if child is None:
            child = self._reasons[reason] = self._rejected.labels(self.name, reason)
        child.inc()


class _EngineCollector(Collector):
    """Reads every model's engine snapshot on every scrape."""

    def __init__(
        self,
        snapshots: dict[str, Callable[[], EngineSnapshot | None]],
        ready: Callable[[], bool],
    ) -> None:
        self.snapshots = snapshots
        self.ready = ready

    def collect(self) -> Iterator[Metric]:
        """Yield the engines' metric families, one sample per model."""
        ready = GaugeMetricFamily(
            "poolserve_ready", "1 when the server accepts work, else 0.", labels=[MODEL_LABEL]
        )
        accepting = int(self.ready())
        for name in self.snapshots:
            ready.add_metric([name], accepting)
        yield ready
        # a model whose engine core did not answer is left out of its families, not zeroed
        taken = [(name, s) for name, read in self.snapshots.items() if (s := read()) is not None]
        if not taken:
            return
        for metric, (kind, doc, value) in ENGINE_SERIES.items():
            family = kind(metric, doc, labels=[MODEL_LABEL])
            for name, snapshot in taken:
                family.add_metric([name], value(snapshot))
            yield family
        # the LoRA families only where a model serves adapters (as vLLM adds them with LoRA)
        adapted = [(name, s.lora) for name, s in taken if isinstance(s.lora, LoraStats)]
        if adapted:
            yield from _lora_families(adapted)


def _lora_families(adapted: list[tuple[str, LoraStats]]) -> Iterator[Metric]:
    """The adapters' gauges and evictions by model, and vLLM's lora_requests_info."""
    for metric, (kind, doc, value) in LORA_SERIES.items():
        family = kind(metric, doc, labels=[MODEL_LABEL])
        for name, lora in adapted:
            family.add_metric([name], value(lora))
        yield family
    # vLLM's info gauge: the adapters of running and waiting requests as comma-joined label
    # values, the sample the Unix time it was read (readers of vLLM's take the newest series)
    info = GaugeMetricFamily(
        "poolserve_lora_requests_info",
        "Running stats on LoRA requests (vLLM's lora_requests_info).",
        labels=[MODEL_LABEL, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    now = time.time()
    for name, lora in adapted:
        labels = [name, str(lora.max_loras), ",".join(lora.running), ",".join(lora.waiting)]
        info.add_metric(labels, now)
    yield info


Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
# metric -> (kind, help, the snapshot's value)
ENGINE_SERIES: dict[str, tuple[Family, str, Callable[[EngineSnapshot], float]]] = {
    "poolserve_running_requests": (
        GaugeMetricFamily,
        "Inputs in a step right now.",
        lambda s: s.num_running,
    ),
    "poolserve_waiting_requests": (
        GaugeMetricFamily,
        "Inputs waiting for their first step.",
        lambda s: s.num_waiting,
    ),
    "poolserve_queued_tokens": (
        GaugeMetricFamily,
        "Prompt tokens of queued and running inputs.",
        lambda s: s.num_queued_tokens,
    ),
    "poolserve_kv_blocks_used": (
        GaugeMetricFamily,
        "KV cache blocks held by running prompts (chunked, or storing prefix blocks).",
        lambda s: s.num_kv_blocks_used,
    ),
    "poolserve_kv_blocks_capacity": (
        GaugeMetricFamily,
        "KV cache blocks in all.",
        lambda s: s.num_kv_blocks_total,
    ),
    "poolserve_kv_blocks_cached": (
        GaugeMetricFamily,
        "Free KV cache blocks still holding a cached prefix (reused on a hit).",
        lambda s: s.num_kv_blocks_cached,
    ),
    "poolserve_open_poolers": (
        GaugeMetricFamily,
        "Pooling states of requests not yet finished or released; zero at idle.",
        lambda s: s.num_open_poolers,
    ),
    "poolserve_step_tokens": (
        CounterMetricFamily,
        "Tokens run through the model.",
        lambda s: s.step_tokens_total,
    ),
    "poolserve_cloned_bytes": (
        CounterMetricFamily,
        "Bytes cloned to own pooled outputs under async scheduling.",
        lambda s: s.cloned_bytes_total,
    ),
    "poolserve_prefix_cache_hit_tokens": (
        CounterMetricFamily,
        "Prompt tokens of last-token requests found in the prefix cache (not computed).",
        lambda s: s.prefix_cache_hit_tokens,
    ),
    "poolserve_prefix_cache_miss_tokens": (
        CounterMetricFamily,
        "Prompt tokens of last-token requests not found in the prefix cache (computed).",
        lambda s: s.prefix_cache_miss_tokens,
    ),
    "poolserve_prefix_cache_evictions": (
        CounterMetricFamily,
        "Cached KV blocks reused for other prompts, least recently freed first.",
        lambda s: s.prefix_cache_evictions,
    ),
}
# metric -> (kind, help, the LoRA stats' value), for each model that serves adapters
LORA_SERIES: dict[str, tuple[Family, str, Callable[[LoraStats], float]]] = {
    "poolserve_lora_adapters_loaded": (
        GaugeMetricFamily,
        "LoRA adapters registered (each in host memory, each a model name).",
        lambda s: s.num_loaded,
    ),
    "poolserve_lora_adapters_resident": (
        GaugeMetricFamily,
        "LoRA adapters in the model's slots now (at most --max-loras).",
        lambda s: s.num_resident,
    ),
    "poolserve_lora_adapter_evictions": (
        CounterMetricFamily,
        "LoRA adapters written out of a slot for another one, least recently used first.",
        lambda s: s.evictions,
    ),
}
