"""/metrics through prometheus_client: the gateway's series keep their names and labels,
the process collector adds memory, CPU and descriptors, and the text parses as Prometheus'
own parser reads it."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.admin.metrics import MetricsMiddleware, metrics_endpoint
from gateway.core.metrics import (
    READINGS,
    EngineView,
    Metrics,
    RusageCollector,
    gauge,
    render,
    stat,
)
from runtime.engine import EngineStats
from runtime.types import FinishReason, GenerationStats

# every family /metrics had before prometheus_client, with its type
FAMILIES = {
    "mlx_gateway_info": "gauge",
    "mlx_gateway_start_time_seconds": "gauge",
    "mlx_gateway_http_requests": "counter",
    "mlx_gateway_http_requests_in_flight": "gauge",
    "mlx_gateway_queue_depth": "gauge",
    "mlx_gateway_engine_busy": "gauge",
    "mlx_gateway_generations": "counter",
    "mlx_gateway_generations_failed": "counter",
    "mlx_gateway_generations_cancelled": "counter",
    "mlx_gateway_generations_finished": "counter",
    "mlx_gateway_prompt_tokens": "counter",
    "mlx_gateway_completion_tokens": "counter",
    "mlx_gateway_prefix_cache_hits": "counter",
    "mlx_gateway_prefix_cache_tokens": "counter",
    "mlx_gateway_time_to_first_token_seconds": "histogram",
    "mlx_gateway_decode_tokens_per_second": "histogram",
    "mlx_gateway_prefill_tokens_per_second": "histogram",
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, read with prometheus_client's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(metrics: Metrics, engine: EngineStats | None = None) -> str:
    return render(metrics, model="tiny", queue_depth=2, engine=engine or EngineStats())


def test_every_family_keeps_its_name_and_type() -> None:
    text = scrape(Metrics())
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, name


def test_engine_readings_and_generation_events() -> None:
    metrics = Metrics()
    metrics.first_token(0.3)
    metrics.first_token(float("nan"))  # not observed: a NaN would poison the sum
    stats = GenerationStats(prompt_tokens=20, completion_tokens=11, cached_tokens=8)
    metrics.generation_done(FinishReason.LENGTH, stats)
    metrics.generation_done(
        FinishReason.STOP, GenerationStats(10, 5, 0, prefill_seconds=0.5, decode_seconds=2.0)
    )
    engine = EngineStats(requests_total=7, completion_tokens_total=16, busy=True)
    got = samples(scrape(metrics, engine))
    assert got[("mlx_gateway_info", (("model", "tiny"),))] == 1
    assert got[("mlx_gateway_queue_depth", ())] == 2
    assert got[("mlx_gateway_engine_busy", ())] == 1
    assert got[("mlx_gateway_generations_total", ())] == 7
    assert got[("mlx_gateway_completion_tokens_total", ())] == 16
    assert got[("mlx_gateway_generations_finished_total", (("reason", "length"),))] == 1
    assert got[("mlx_gateway_generations_finished_total", (("reason", "stop"),))] == 1
    assert got[("mlx_gateway_prefix_cache_hits_total", ())] == 1
    assert got[("mlx_gateway_prefix_cache_tokens_total", ())] == 8
    assert got[("mlx_gateway_time_to_first_token_seconds_count", ())] == 1
    assert got[("mlx_gateway_time_to_first_token_seconds_sum", ())] == pytest.approx(0.3)
    assert got[("mlx_gateway_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 0
    assert got[("mlx_gateway_time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("mlx_gateway_decode_tokens_per_second_sum", ())] == pytest.approx(2.0)
    assert got[("mlx_gateway_prefill_tokens_per_second_sum", ())] == pytest.approx(20.0)


def test_each_app_counts_on_its_own() -> None:
    first, second = Metrics(), Metrics()
    first.request_done("GET", "/health", 200)
    key = (
        "mlx_gateway_http_requests_total",
        (("method", "GET"), ("route", "/health"), ("status", "200")),
    )
    assert samples(scrape(first))[key] == 1
    assert key not in samples(scrape(second))


def test_a_new_engine_gauge_is_one_reading() -> None:
    running = gauge("running_sequences", "Sequences in the running batch.", stat("running"))
    view = EngineView(model="m", queue_depth=0, stats=EngineStats(running=3))
    family = running.family(view)
    assert (family.name, family.type, family.samples[0].value) == (
        "mlx_gateway_running_sequences",
        "gauge",
        3,
    )
    for reading in READINGS:  # every reading names a real EngineStats field
        assert math.isfinite(reading.family(view).samples[0].value)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="prometheus_client reads /proc")
def test_process_collector() -> None:
    got = samples(scrape(Metrics()))
    assert got[("process_resident_memory_bytes", ())] > 1e6
    assert got[("process_cpu_seconds_total", ())] > 0
    assert got[("process_open_fds", ())] >= 3
    assert got[("process_max_fds", ())] >= got[("process_open_fds", ())]


def test_rusage_collector_where_there_is_no_proc() -> None:
    families = {f.name: f for f in RusageCollector().collect()}
    assert families["process_cpu_seconds"].samples[0].value > 0
    assert families["process_peak_resident_memory_bytes"].samples[0].value > 1e6
    assert families["process_open_fds"].samples[0].value >= 3


def test_middleware_and_endpoint() -> None:
    metrics = Metrics()

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hi")

    async def broken(request: Request) -> PlainTextResponse:
        return PlainTextResponse("no", status_code=503)

    app = Starlette(
        routes=[
            Route("/hello/{name}", hello),
            Route("/broken", broken),
            Route("/metrics", metrics_endpoint),
        ]
    )
    app.state.metrics = metrics
    model = SimpleNamespace(
        spec=SimpleNamespace(id="tiny"), queue_depth=4, stats=EngineStats(prompt_tokens_total=12)
    )
    app.state.models = SimpleNamespace(status=lambda: [model])  # a registry's status()
    client = TestClient(MetricsMiddleware(app, metrics=metrics))
    for name in ("a", "b"):
        assert client.get(f"/hello/{name}").status_code == 200
    client.get("/broken")
    client.get("/random/path/1")
    client.get("/random/path/2")
    r = client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    got = samples(r.text)

    def requests(route: str, status: str) -> float:
        labels = (("method", "GET"), ("route", route), ("status", status))
        return got[("mlx_gateway_http_requests_total", labels)]

    assert requests("/hello/{name}", "200") == 2  # the route's template, not each URL
    assert requests("/broken", "503") == 1
    assert requests("unmatched", "404") == 2
    assert got[("mlx_gateway_http_requests_in_flight", ())] == 1  # the scrape itself
    assert got[("mlx_gateway_queue_depth", ())] == 4
    assert got[("mlx_gateway_prompt_tokens_total", ())] == 12
    assert samples(client.get("/metrics").text)[("mlx_gateway_http_requests_in_flight", ())] == 1


def test_allocator_series_follow_mlx() -> None:
    """MLX's allocator: an array kept is active; freed, its buffer sits in the cache."""
    import mlx.core as mx

    limit = mx.set_cache_limit(1 << 30)
    try:
        before = samples(scrape(Metrics()))
        kept = mx.zeros((4 << 20,), dtype=mx.float32)  # 16 MB
        mx.eval(kept)
        held = samples(scrape(Metrics()))
        name = "mlx_gateway_mlx_{}_memory_bytes"
        grown = held[(name.format("active"), ())] - before[(name.format("active"), ())]
        assert grown >= 16 << 20
        assert held[(name.format("peak"), ())] >= held[(name.format("active"), ())]
        del kept
        freed = samples(scrape(Metrics()))
        assert freed[(name.format("cache"), ())] >= 16 << 20
        assert freed[(name.format("active"), ())] <= held[(name.format("active"), ())] - (16 << 20)
    finally:
        mx.set_cache_limit(limit)
