"""GET /metrics in Prometheus' text format, and what feeds it.

HTTP counts come from a middleware; time to first token, speeds and prefix-cache hits
from the generations the routes watch; token totals and queue depth from the engine.
Everything here runs on the event loop thread, so plain counters suffice.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.engine import EngineStats
from runtime.types import FinishReason, GenerationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "mlx_gateway_"

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        if math.isnan(value):
            return
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        pairs = zip(self.buckets, self.counts, strict=True)
        out = [f'{name}_bucket{{le="{_num(b)}"}} {c}' for b, c in pairs]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_num(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


@dataclass
class Metrics:
    started: float = field(default_factory=time.time)
    requests: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    in_flight: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    cached_tokens: int = 0
    prefix_hits: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    decode_tps: Histogram = field(default_factory=lambda: Histogram(TPS_BUCKETS))
    prefill_tps: Histogram = field(default_factory=lambda: Histogram(TPS_BUCKETS))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def generation_done(self, reason: FinishReason, stats: GenerationStats) -> None:
        self.finished[reason.value] += 1
        self.cached_tokens += stats.cached_tokens
        if stats.cached_tokens > 0:
            self.prefix_hits += 1
        if stats.completion_tokens > 1 and stats.decode_seconds > 0:
            self.decode_tps.observe(stats.decode_tps)
        if stats.prefill_seconds > 0 and stats.prompt_tokens > stats.cached_tokens:
            self.prefill_tps.observe(stats.prefill_tps)


def _num(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def _family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    full = PREFIX + name
    # samples spell the metric's name as "@" (histogram lines add their own suffixes)
    lines = [s.replace("@", full, 1) for s in samples]
    return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", *lines]


def _counter(name: str, help_text: str, value: float, kind: str = "counter") -> list[str]:
    return _family(name, kind, help_text, [f"@ {_num(value)}"])


def render(metrics: Metrics, *, model: str, queue_depth: int, engine: EngineStats) -> str:
    """The exposition text; `engine` is read, never written (the worker owns it)."""
    requests = [
        f"@{_labels(method=m, route=r, status=s)} {n}"
        for (m, r, s), n in sorted(metrics.requests.items())
    ]
    finished = [f"@{_labels(reason=r)} {n}" for r, n in sorted(metrics.finished.items())]
    out = _family("info", "gauge", "The served model.", [f"@{_labels(model=model)} 1"])
    out += _counter("start_time_seconds", "Unix time the server started.", metrics.started, "gauge")
    out += _family("http_requests_total", "counter", "HTTP requests by route and status.", requests)
    out += _counter(
        "http_requests_in_flight", "HTTP requests being served.", metrics.in_flight, "gauge"
    )
    out += _counter("queue_depth", "Generations waiting for the engine.", queue_depth, "gauge")
    out += _counter(
        "engine_busy", "1 while the engine runs a generation.", int(engine.busy), "gauge"
    )
    out += _counter("generations_total", "Generations the engine took.", engine.requests_total)
    out += _counter("generations_failed_total", "Generations that failed.", engine.requests_failed)
    out += _counter(
        "generations_cancelled_total",
        "Generations cancelled (client gone).",
        engine.requests_cancelled,
    )
    out += _family(
        "generations_finished_total", "counter", "Generations read to the end, by reason.", finished
    )
    out += _counter("prompt_tokens_total", "Prompt tokens processed.", engine.prompt_tokens_total)
    out += _counter("completion_tokens_total", "Tokens generated.", engine.completion_tokens_total)
    out += _counter(
        "prefix_cache_hits_total",
        "Generations that reused cached prompt state.",
        metrics.prefix_hits,
    )
    out += _counter(
        "prefix_cache_tokens_total",
        "Prompt tokens served from the prefix cache.",
        metrics.cached_tokens,
    )
    out += _family(
        "time_to_first_token_seconds",
        "histogram",
        "From submission (queue wait included) to the first token.",
        metrics.ttft.lines("@"),
    )
    out += _family(
        "decode_tokens_per_second",
        "histogram",
        "Decode speed per generation.",
        metrics.decode_tps.lines("@"),
    )
    out += _family(
        "prefill_tokens_per_second",
        "histogram",
        "Prefill speed per generation (uncached tokens).",
        metrics.prefill_tps.lines("@"),
    )
    return "\n".join(out) + "\n"


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    # unmatched paths share one label, so random URLs cannot grow the series without bound
    return path if isinstance(path, str) else "unmatched"


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.metrics
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        metrics.in_flight += 1
        try:
            await self.app(scope, receive, watch)
        finally:
            metrics.in_flight -= 1
            metrics.requests[(scope["method"], _route(scope), str(status))] += 1


async def metrics_endpoint(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    served = request.app.state.served
    engine = served.engine
    text = render(metrics, model=served.id, queue_depth=engine.queue_depth, engine=engine.stats)
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
