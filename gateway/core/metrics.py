"""GET /metrics in Prometheus' text format (prometheus_client), and what feeds it.

Two kinds of series. What the gateway sees happen (HTTP requests, from a middleware; first
tokens, speeds and prefix-cache hits, from the generations the routes watch) lives in
prometheus_client metrics on the `Metrics` object. What the engine owns (queue depth,
token totals, busy) is read once per scrape through `READINGS`: a new engine gauge is one
row there. With several models configured, those engine series carry a `model` label (one
sample per model); with one, no label, as before. The per-generation series are summed
over the models. Each app has its own registry, with the process collector (resident memory,
CPU seconds, open file descriptors).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from runtime.engine import EngineStats, allocator_bytes
from runtime.types import FinishReason, GenerationStats

if TYPE_CHECKING:
    pass

PREFIX = "mlx_gateway_"

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0)
ENCODE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


@dataclass(frozen=True)
class EngineView:
    """What one scrape reads from the served model's engine (the worker owns it)."""

    model: str
    queue_depth: int
    stats: EngineStats


@dataclass(frozen=True)
class Reading:
    """A series whose value the engine holds, read at scrape time."""

    name: str  # without PREFIX; a counter's ends in _total
    kind: Literal["gauge", "counter"]
    help: str
    read: Callable[[EngineView], float]

    def family(self, view: EngineView) -> Metric:
        value = float(self.read(view))
        if self.kind == "counter":
            return CounterMetricFamily(PREFIX + self.name, self.help, value=value)
        return GaugeMetricFamily(PREFIX + self.name, self.help, value=value)

    def labelled(self, views: Sequence[EngineView]) -> Metric:
        """One sample per model, labelled with its id (a server with several models)."""
        kind = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        family = kind(PREFIX + self.name, self.help, labels=["model"])
        for view in views:
            family.add_metric([view.model], float(self.read(view)))
        return family


def gauge(name: str, help_text: str, read: Callable[[EngineView], float]) -> Reading:
    return Reading(name, "gauge", help_text, read)


def counter(name: str, help_text: str, read: Callable[[EngineView], float]) -> Reading:
    return Reading(name, "counter", help_text, read)


def stat(field: str) -> Callable[[EngineView], float]:
    """Reads one field of the engine's EngineStats."""
    return lambda view: float(getattr(view.stats, field))


READINGS: tuple[Reading, ...] = (
    gauge("queue_depth", "Generations waiting for the engine.", lambda v: v.queue_depth),
    gauge("engine_busy", "1 while the engine runs a generation.", stat("busy")),
    counter("generations_total", "Generations the engine took.", stat("requests_total")),
    counter("generations_failed_total", "Generations that failed.", stat("requests_failed")),
    counter(
        "generations_cancelled_total",
        "Generations cancelled (client gone).",
        stat("requests_cancelled"),
    ),
    counter("prompt_tokens_total", "Prompt tokens processed.", stat("prompt_tokens_total")),
    counter("completion_tokens_total", "Tokens generated.", stat("completion_tokens_total")),
)


class Metrics:
    """The gateway's own series, in a registry of its own (one per app, so apps and tests
    never share counts). prometheus_client metrics lock, so any thread may update them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.started = time.time()
        r = self.registry
        self.http_requests = Counter(
            PREFIX + "http_requests_total",
            "HTTP requests by route and status.",
            ("method", "route", "status"),
            registry=r,
        )
        self.in_flight = Gauge(
            PREFIX + "http_requests_in_flight", "HTTP requests being served.", registry=r
        )
        self.finished = Counter(
            PREFIX + "generations_finished_total",
            "Generations read to the end, by reason.",
            ("reason",),
            registry=r,
        )
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits_total",
            "Generations that reused cached prompt state.",
            registry=r,
        )
        self.cached_tokens = Counter(
            PREFIX + "prefix_cache_tokens_total",
            "Prompt tokens served from the prefix cache.",
            registry=r,
        )
        self.drafted_tokens = Counter(
            PREFIX + "speculative_drafted_tokens_total",
            "Tokens drafted (prompt lookup, predicted outputs) and checked in one forward.",
            registry=r,
        )
        self.accepted_tokens = Counter(
            PREFIX + "speculative_accepted_tokens_total",
            "Drafted tokens the model wrote too (each saved a decode step).",
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From submission (queue wait included) to the first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.decode_tps = Histogram(
            PREFIX + "decode_tokens_per_second",
            "Decode speed per generation.",
            buckets=TPS_BUCKETS,
            registry=r,
        )
        self.prefill_tps = Histogram(
            PREFIX + "prefill_tokens_per_second",
            "Prefill speed per generation (uncached tokens).",
            buckets=TPS_BUCKETS,
            registry=r,
        )
        self._encoder_series()
        Gauge(PREFIX + "start_time_seconds", "Unix time the server started.", registry=r).set(
            self.started
        )
        r.register(AllocatorCollector())
        if os.path.isdir("/proc/self"):
            ProcessCollector(registry=r)
        else:  # macOS: prometheus_client's process collector reads only /proc
            r.register(RusageCollector())

    def _encoder_series(self) -> None:
        """/v1/embeddings and /v1/rerank, by task ("embed", "rerank")."""
        r, task = self.registry, ("task",)
        self.encode_requests = Counter(
            PREFIX + "encode_requests_total",
            "Embedding and rerank requests the encoder ended, by task and reason.",
            ("task", "reason"),
            registry=r,
        )
        self.encode_inputs = Counter(
            PREFIX + "encode_inputs_total",
            "Inputs embedded, or (query, document) pairs scored.",
            task,
            registry=r,
        )
        self.encode_tokens = Counter(
            PREFIX + "encode_tokens_total",
            "Tokens of those inputs (special tokens included).",
            task,
            registry=r,
        )
        self.encode_cached_tokens = Counter(
            PREFIX + "encode_cached_tokens_total",
            "Tokens of inputs served from the encoder's cache of recent rows.",
            task,
            registry=r,
        )
        self.encode_seconds = Histogram(
            PREFIX + "encode_request_seconds",
            "From submission (queue wait included) to the encoder's last row.",
            task,
            buckets=ENCODE_BUCKETS,
            registry=r,
        )

    def encode_done(
        self, task: str, reason: FinishReason, inputs: int, stats: GenerationStats, seconds: float
    ) -> None:
        """An embedding or rerank request ended (`task`: the model's, "embed" or "rerank")."""
        self.encode_requests.labels(task=task, reason=reason.value).inc()
        if reason is not FinishReason.STOP:
            return
        self.encode_inputs.labels(task=task).inc(inputs)
        self.encode_tokens.labels(task=task).inc(stats.prompt_tokens)
        self.encode_cached_tokens.labels(task=task).inc(stats.cached_tokens)
        _observe(self.encode_seconds.labels(task=task), seconds)

    def request_done(self, method: str, route: str, status: int) -> None:
        self.http_requests.labels(method=method, route=route, status=str(status)).inc()

    def first_token(self, seconds: float) -> None:
        _observe(self.ttft, seconds)

    def generation_done(self, reason: FinishReason, stats: GenerationStats) -> None:
        self.finished.labels(reason=reason.value).inc()
        self.cached_tokens.inc(stats.cached_tokens)
        self.drafted_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        if stats.cached_tokens > 0:
            self.prefix_hits.inc()
        if stats.completion_tokens > 1 and stats.decode_seconds > 0:
            _observe(self.decode_tps, stats.decode_tps)
        if stats.prefill_seconds > 0 and stats.prompt_tokens > stats.cached_tokens:
            _observe(self.prefill_tps, stats.prefill_tps)

    def render(self, views: EngineView | Sequence[EngineView]) -> str:
        """With one model the engine series carry no label (as they always have); with
        several, each gets a `model` label and one sample per configured model."""
        views = (views,) if isinstance(views, EngineView) else tuple(views)
        return generate_latest(_Scrape(self.registry, views)).decode("utf-8")


def _observe(histogram: Histogram, value: float) -> None:
    if not math.isnan(value):
        histogram.observe(value)


class _Scrape(Collector):
    """One scrape: the served models, the engines' readings, then the registry."""

    def __init__(self, registry: CollectorRegistry, views: tuple[EngineView, ...]) -> None:
        self._registry = registry
        self._views = views

    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(PREFIX + "info", "The served models.", labels=["model"])
        for view in self._views:
            info.add_metric([view.model], 1)
        yield info
        for reading in READINGS:
            if len(self._views) == 1:
                yield reading.family(self._views[0])
            else:
                yield reading.labelled(self._views)
        yield from self._registry.collect()


class AllocatorCollector(Collector):
    """MLX's allocator (runtime/engine/memory.py): arrays alive, freed buffers kept for
    reuse (they count in resident memory, up to the buffer cache's limit), its peak."""

    def collect(self) -> Iterable[Metric]:
        held = allocator_bytes()
        for name, help_text, value in (
            (
                "active",
                "Bytes of MLX arrays alive (weights, caches, a step's arrays).",
                held.active,
            ),
            ("cache", "Bytes of freed MLX buffers kept for reuse (bounded).", held.cache),
            ("peak", "The most bytes MLX arrays held at once since start.", held.peak),
        ):
            yield GaugeMetricFamily(f"{PREFIX}mlx_{name}_memory_bytes", help_text, value=value)


class RusageCollector(Collector):
    """Process series where there is no /proc: CPU time and peak resident memory from
    getrusage (the current size needs /proc), open descriptors from /dev/fd."""

    def collect(self) -> Iterable[Metric]:
        try:
            import resource
        except ImportError:  # Windows
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        yield CounterMetricFamily(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            value=usage.ru_utime + usage.ru_stime,
        )
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
        yield GaugeMetricFamily(
            "process_peak_resident_memory_bytes",
            "Largest resident memory size in bytes.",
            value=usage.ru_maxrss * scale,
        )
        with contextlib.suppress(OSError):
            count = len(os.listdir("/dev/fd"))
            yield GaugeMetricFamily(
                "process_open_fds", "Number of open file descriptors.", value=count
            )


def render(metrics: Metrics, *, model: str, queue_depth: int, engine: EngineStats) -> str:
    """The exposition text; `engine` is read, never written (the worker owns it)."""
    return metrics.render(EngineView(model=model, queue_depth=queue_depth, stats=engine))
