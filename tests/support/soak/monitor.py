"""What the soak watches while the load runs: the server's resident memory, open file
descriptors and threads (from /proc, every few seconds), its /health and /metrics, and
now and then each model's prefix cache (/debug/prefix-cache). Read-only: it never
changes the server."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    at: float  # seconds since the load began
    rss: int  # bytes
    fds: int
    threads: int
    health: dict[str, Any]
    metrics: dict[str, float]  # a few series of /metrics, summed over their labels


def proc_status(pid: int) -> tuple[int, int, int]:
    """(resident bytes, open file descriptors, threads) of a live process."""
    fields: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    rss = int(fields["VmRSS"].split()[0]) * 1024
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    return rss, fds, int(fields["Threads"])


# summed over their labels; what the table reports besides /proc's figures
SERIES = (
    "process_resident_memory_bytes",
    "process_open_fds",
    "mlx_gateway_generations_total",
    "mlx_gateway_generations_failed_total",
    "mlx_gateway_generations_cancelled_total",
    "mlx_gateway_prefix_cache_hits_total",
    "mlx_gateway_prefix_cache_tokens_total",
    "mlx_gateway_mlx_active_memory_bytes",
    "mlx_gateway_mlx_cache_memory_bytes",
)


RSS = "process_resident_memory_bytes"
CACHE = "mlx_gateway_mlx_cache_memory_bytes"


def _held(s: Sample) -> int | None:
    """Resident memory less the freed buffers MLX keeps for reuse: those swing between
    nothing and their limit with what ran last, and hold nothing a leak would."""
    if RSS not in s.metrics or CACHE not in s.metrics:
        return None
    return int(s.metrics[RSS] - s.metrics[CACHE])


def read_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    by_status: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SERIES:
                out[s.name] = out.get(s.name, 0.0) + s.value
            if s.name == "mlx_gateway_http_requests_total":
                status = s.labels.get("status", "?")
                by_status[status] = by_status.get(status, 0.0) + s.value
    for status, value in by_status.items():
        out[f"http_{status}"] = value
    return out


@dataclass
class Monitor:
    """Samples the server every `interval` seconds on a thread of its own."""

    url: str
    pid: int
    interval: float = 5.0
    models: tuple[str, ...] = ()
    samples: list[Sample] = field(default_factory=list)
    caches: list[tuple[float, dict[str, dict[str, int]]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> Sample | None:
        at = time.monotonic() - self.began  # when /proc was read, not when /metrics answered
        try:
            rss, fds, threads = proc_status(self.pid)
        except (OSError, KeyError, ValueError) as exc:
            self.errors.append(f"/proc: {exc}")
            return None
        health: dict[str, Any] = {}
        metrics: dict[str, float] = {}
        with httpx.Client(base_url=self.url, timeout=60) as client:  # no connection kept
            try:
                health = client.get("/health").json()
                metrics = read_metrics(client.get("/metrics").text)
            except (httpx.HTTPError, ValueError) as exc:
                self.errors.append(f"/health or /metrics: {type(exc).__name__}: {exc}")
        s = Sample(at, rss, fds, threads, health, metrics)
        self.samples.append(s)
        return s

    def prefix_caches(self) -> dict[str, dict[str, int]]:
        """Each loaded model's prefix-cache counters."""
        out: dict[str, dict[str, int]] = {}
        with httpx.Client(base_url=self.url, timeout=60) as client:
            for model in self.models:
                r = client.get("/debug/prefix-cache", params={"model": model})
                if r.status_code == 200:
                    out[model] = r.json()["stats"]
        return out

    def start(self) -> None:
        self.began = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval):
            self.sample()
            n += 1
            if n % 6 == 0:
                try:
                    self.caches.append((time.monotonic() - self.began, self.prefix_caches()))
                except httpx.HTTPError as exc:
                    self.errors.append(f"/debug/prefix-cache: {exc}")

    # -- figures --

    def floor_between(self, start: float, end: float) -> int | None:
        """The lowest resident size less MLX's buffer cache of the samples taken in
        [start, end] seconds (both figures from one scrape of /metrics)."""
        values = [held for s in self.samples if start <= s.at <= end if (held := _held(s))]
        return min(values) if values else None

    def cache_peak(self) -> int:
        """The most MLX's buffer cache held at a sample."""
        return max((int(s.metrics.get(CACHE, 0)) for s in self.samples), default=0)

    def peak_after(self, start: float) -> int | None:
        values = [s.rss for s in self.samples if s.at >= start]
        return max(values) if values else None

    def health_worst(self) -> tuple[int, int, set[str]]:
        """The most engine failures and restarts /health reported, and the states seen."""
        failures = restarts = 0
        states: set[str] = set()
        for s in self.samples:
            failures = max(failures, int(s.health.get("engine_failures", 0) or 0))
            restarts = max(restarts, int(s.health.get("engine_restarts", 0) or 0))
            if "state" in s.health:
                states.add(str(s.health["state"]))
        return failures, restarts, states
