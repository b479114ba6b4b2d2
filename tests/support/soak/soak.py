"""The soak: minutes to hours of mixed load against a real `mlx-gateway serve` on
loopback, every answer checked against the SDKs' types, the server's memory, file
descriptors and prefix cache watched; a table at the end, exit 1 if a criterion fails.

    python tests/support/soak/soak.py [--minutes 30] [--clients 8] [--model smollm2-135m]

The server serves one model file twice (its own template; a tool-calling template), with
the prefix cache's disk tier in a temporary folder and a small queue (so bursts get
429s). Each client loops over a weighted mix (tests/support/soak/kinds.py): OpenAI chat
streamed and not, Anthropic messages streamed and not, Responses, tool calls with
tool_choice auto / required / named, long prompts, repeated prompts, n > 1, structured
output, disconnects mid-stream, malformed bodies, bursts. Before the clock starts, one
request of each kind runs alone (priming: both models loaded, every path compiled).

Criteria: no invalid answer, no 5xx but 503s, no lost request, every kind exercised;
resident memory less MLX's buffer cache (which has its own bound, the cache limit)
flat within --rss-tolerance, low-water mark against low-water mark, from the first
fifth after the warm-up (5 minutes, or the first sixth of a shorter run) to the last
fifth (the peak is printed beside it); open file descriptors back to where they began;
each model's prefix cache within its budgets with exactly its entries on disk; no
engine failure; no traceback in the server's log; SIGTERM exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import httpx  # noqa: E402

from runtime.engine.runner import DEFAULT_BUFFER_CACHE_BYTES  # noqa: E402
from tests.support.soak import kinds  # noqa: E402
from tests.support.soak.kinds import Ctx, Outcome  # noqa: E402
from tests.support.soak.monitor import Monitor, proc_status  # noqa: E402
from tests.support.soak.prompts import Prompts  # noqa: E402
from tests.support.soak.server import CHAT_MODEL, TOOLS_MODEL, Gateway, Options  # noqa: E402

WARMUP_S = 300.0  # the "after the first 5 minutes"
FD_SLACK = 2  # descriptors a settled server may hold beyond its start (a keep-alive)
SETTLE_S = 30.0
REQUEST_TIMEOUT_S = 600.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="load duration (default 30)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--model", default="smollm2-135m", help="alias or path, as serve takes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--prefix-cache-bytes", default="16M")
    p.add_argument("--prefix-cache-disk-bytes", default="1G")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    return p


@dataclass(frozen=True)
class Criterion:
    name: str
    value: str
    bound: str
    ok: bool


# -- the load ------------------------------------------------------------------------------


class Load:
    """The clients, their outcomes (with when each ended), the deadline."""

    def __init__(self, url: str, args: argparse.Namespace, prompts: Prompts) -> None:
        self.url = url
        self.args = args
        self.prompts = prompts
        self.outcomes: list[tuple[float, Outcome]] = []
        self.lock = threading.Lock()
        self.began = time.monotonic()

    def ctx(self, client: httpx.Client, seed: int) -> Ctx:
        return Ctx(client, random.Random(seed), self.prompts, CHAT_MODEL, TOOLS_MODEL,
                   burst=2 * (self.args.max_queue + self.args.max_batch), min_tokens=self.args.min_tokens,
                   max_tokens=self.args.max_tokens)  # fmt: skip

    def record(self, outs: list[Outcome]) -> None:
        now = time.monotonic() - self.began
        with self.lock:
            self.outcomes += [(now, o) for o in outs]

    def prime(self) -> None:
        """One of each kind, alone (loads both models and warms every path), then one
        round of every client at once, two of them with long prompts: MLX's buffer
        cache (256 MB) and the allocator fill to what steady load keeps before the
        clock starts, so the first fifth's memory is not still climbing."""
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as client:
            ctx = self.ctx(client, self.args.seed)
            for kind in kinds.WEIGHTS:
                self.record(kinds.run(ctx, kind))

        def one(i: int) -> None:
            with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as client:
                ctx = self.ctx(client, self.args.seed * 1000 - i - 1)
                self.record(kinds.run(ctx, "long" if i < 2 else kinds.pick(ctx.rng)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(self.args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def run(self, seconds: float) -> float:
        """The clients until `seconds` have passed (what runs then finishes); returns
        when the last one ended, in seconds since the start."""
        self.began = time.monotonic()
        deadline = self.began + seconds
        threads = [
            threading.Thread(target=self._client, args=(i, deadline), name=f"soak-client-{i}")
            for i in range(self.args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - self.began

    def _client(self, i: int, deadline: float) -> None:
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as client:
            ctx = self.ctx(client, self.args.seed * 1000 + i + 1)
            while time.monotonic() < deadline:
                self.record(kinds.run(ctx, kinds.pick(ctx.rng)))


# -- what the run shows ----------------------------------------------------------------------


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.0f} MB"


def _settle_fds(pid: int, limit: int) -> int:
    """The descriptor count once it is back under `limit` (the clients' connections
    closing), or what it is after SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        fds = proc_status(pid)[1]
        if fds <= limit or time.monotonic() > deadline:
            return fds
        time.sleep(0.5)


def _cache_checks(gateway: Gateway, monitor: Monitor) -> tuple[list[Criterion], dict[str, Any]]:
    """Each model's prefix cache at the end: memory and disk within their budgets, and
    the files on disk exactly its entries (once the writer is idle)."""
    out: list[Criterion] = []
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = monitor.prefix_caches()
        files = {m: gateway.cache_files(m) for m in stats}
        settled = all(
            len(files[m][0]) == s.get("disk_entries") and not files[m][1] for m, s in stats.items()
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for model, s in stats.items():
        whole, partial = files[model]
        on_disk = sum(p.stat().st_size for p in whole)
        ok = (
            s["paged_bytes"] <= s["budget_bytes"]
            and s.get("disk_bytes", 0) <= s.get("disk_budget_bytes", 0)
            and len(whole) == s.get("disk_entries")
            and not partial
            and on_disk <= s.get("disk_bytes", 0)
        )
        value = (
            f"live {s['snapshots']} snapshots, {_mb(s['paged_bytes'])}; disk "
            f"{s.get('disk_snapshots', 0)} snapshots in {s.get('disk_entries', 0)} entries, "
            f"{_mb(s.get('disk_bytes'))}; {len(whole)} files ({_mb(on_disk)}), {len(partial)} .tmp"
        )
        bound = f"<= {_mb(s['budget_bytes'])} / {_mb(s.get('disk_budget_bytes'))}, files = entries"
        out.append(Criterion(f"prefix cache {model}", value, bound, ok))
    return out, stats


def _by_kind(outcomes: Sequence[Outcome]) -> dict[str, Counter[str]]:
    table: dict[str, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        table[o.kind][o.verdict] += 1
        table[o.kind]["sent"] += 1
        table[o.kind]["hits"] += o.cached > 0
    return table


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_table(outcomes: Sequence[Outcome]) -> None:
    table = _by_kind(outcomes)
    seconds: dict[str, list[float]] = defaultdict(list)
    for o in outcomes:
        seconds[o.kind].append(o.seconds)
    cols = ("sent", *kinds.VERDICTS, "hits")
    print(f"{'kind':<18}" + "".join(f"{c:>8}" for c in cols) + f"{'p50 s':>8}{'p95 s':>8}")
    total: Counter[str] = Counter()
    for kind in kinds.WEIGHTS:
        row = table.get(kind, Counter())
        total.update(row)
        times = seconds.get(kind, [])
        print(f"{kind:<18}" + "".join(f"{row[c]:>8}" for c in cols)
              + f"{_percentile(times, 0.5):>8.1f}{_percentile(times, 0.95):>8.1f}")  # fmt: skip
    every = [o.seconds for o in outcomes]
    print(f"{'total':<18}" + "".join(f"{total[c]:>8}" for c in cols)
          + f"{_percentile(every, 0.5):>8.1f}{_percentile(every, 0.95):>8.1f}")  # fmt: skip


def print_criteria(criteria: Sequence[Criterion]) -> None:
    width = max(len(c.name) for c in criteria)
    for c in criteria:
        mark = "PASS" if c.ok else "FAIL"
        print(f"  {mark}  {c.name:<{width}}  {c.value}   (bound: {c.bound})")


# -- the run ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="mlx-gateway-soak-"))
    options = Options(
        args.model, args.max_queue, args.max_batch, args.prefix_cache_bytes,
        args.prefix_cache_disk_bytes,
    )  # fmt: skip
    gateway = Gateway(folder, options)
    try:
        return _soak(args, gateway)
    finally:
        gateway.kill()
        if args.keep:
            print(f"kept {folder}")
        else:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


def _soak(args: argparse.Namespace, gateway: Gateway) -> int:
    seconds = args.minutes * 60
    warmup = min(WARMUP_S, seconds / 6)
    window = max(2 * args.interval, seconds / 30)  # the shortest span a figure is read over
    print(f"soak: {args.minutes:g} min, {args.clients} clients, {args.model} "
          f"(as {CHAT_MODEL} and {TOOLS_MODEL}), log {gateway.log}", flush=True)  # fmt: skip
    gateway.wait_ready()
    load = Load(gateway.url, args, Prompts.make(args.seed))
    load.prime()
    primed = [o for _, o in load.outcomes]
    monitor = Monitor(gateway.url, gateway.pid, args.interval, (CHAT_MODEL, TOOLS_MODEL))
    monitor.start()
    first = monitor.sample()
    ended = load.run(seconds)
    monitor.stop()
    last = monitor.sample()
    assert first is not None and last is not None, monitor.errors
    fds_end = _settle_fds(gateway.pid, first.fds + FD_SLACK)
    threads_end = proc_status(gateway.pid)[2]
    cache_criteria, cache_stats = _cache_checks(gateway, monitor)
    code, stop_s = gateway.stop()
    tracebacks, error_lines = gateway.log_problems()
    leftover = [p for m in (CHAT_MODEL, TOOLS_MODEL) for p in gateway.cache_files(m)[1]]

    during = [o for _, o in load.outcomes[len(primed) :]]
    outcomes = primed + during
    verdicts = Counter(o.verdict for o in outcomes)
    # low-water marks of the first and the last fifth after the warm-up, of resident
    # memory less MLX's buffer cache. The resident size swings by half with what runs
    # when a sample is taken: a batch that holds a long prompt pads its other rows' keys
    # and values to its length (4 rows x 3k tokens x 46 KB on SmolLM2), so which fifth's
    # high-water mark catches such a moment is chance (+31% in a one-minute run whose
    # floor moved 3%). The buffer cache swings between nothing and its limit (256 MB, a
    # fifth of SmolLM2's server) with what ran last, its floor too: it has a criterion
    # of its own, its bound. What a leak keeps, or an allocator that never returns what
    # a spike took, raises the floor.
    span = max(window, (ended - warmup) / 5)
    rss_warm = monitor.floor_between(warmup, warmup + span)
    rss_end = monitor.floor_between(ended - span, ended)
    drift = None if not rss_warm or rss_end is None else rss_end / rss_warm - 1
    failures, restarts, states = monitor.health_worst()
    missing = [k for k in kinds.WEIGHTS if not any(o.kind == k for o in outcomes)]
    criteria = [
        Criterion("invalid responses", str(verdicts[kinds.INVALID]), "0", not verdicts[kinds.INVALID]),
        Criterion("5xx other than 503", str(verdicts[kinds.SERVER_ERROR]), "0",
                  not verdicts[kinds.SERVER_ERROR]),
        Criterion("lost requests", str(verdicts[kinds.LOST]), "0", not verdicts[kinds.LOST]),
        Criterion("kinds exercised", f"{len(kinds.WEIGHTS) - len(missing)} of {len(kinds.WEIGHTS)}"
                  + (f" (missing {', '.join(missing)})" if missing else ""), "all", not missing),
        Criterion("MLX buffer cache, peak", _mb(monitor.cache_peak()),
                  f"<= {_mb(DEFAULT_BUFFER_CACHE_BYTES)}",
                  monitor.cache_peak() <= DEFAULT_BUFFER_CACHE_BYTES),
        Criterion(
            f"RSS less buffer cache, low-water, {warmup / 60:.1f}-{(warmup + span) / 60:.1f} min -> last "
            f"{span / 60:.1f} min",
            f"{_mb(rss_warm)} -> {_mb(rss_end)}"
            + ("" if drift is None else f" ({drift:+.1%}); peak {_mb(monitor.peak_after(warmup))}"),
            f"within {args.rss_tolerance:.0%}",
            drift is not None and abs(drift) <= args.rss_tolerance,
        ),
        Criterion("open fds start -> end", f"{first.fds} -> {fds_end}",
                  f"<= start + {FD_SLACK}", fds_end <= first.fds + FD_SLACK),
        *cache_criteria,
        Criterion("engine failures / restarts (/health)", f"{failures} / {restarts}; states "
                  + ", ".join(sorted(states)), "0 / 0", failures == 0 and restarts == 0),
        Criterion("monitor errors (/proc, /health, /metrics)", str(len(monitor.errors)), "0",
                  not monitor.errors),
        Criterion("tracebacks in the server log", str(tracebacks), "0", tracebacks == 0),
        Criterion("SIGTERM -> exit", f"{code} in {stop_s:.1f} s, {len(leftover)} .tmp left",
                  "0, none left", code == 0 and not leftover),
    ]  # fmt: skip

    print()
    print(f"requests: {len(primed)} priming + {len(during)} in {ended / 60:.1f} min "
          f"({len(during) / max(ended, 1e-9):.2f}/s), {args.clients} clients")  # fmt: skip
    print_table(outcomes)
    print()
    print(f"server: threads {first.threads} -> {threads_end}; "
          f"/metrics RSS {_mb(int(last.metrics.get('process_resident_memory_bytes', 0)))}, "
          f"generations {last.metrics.get('mlx_gateway_generations_total', 0):.0f} "
          f"(failed {last.metrics.get('mlx_gateway_generations_failed_total', 0):.0f}, "
          f"cancelled {last.metrics.get('mlx_gateway_generations_cancelled_total', 0):.0f}), "
          f"prefix-cache hits {last.metrics.get('mlx_gateway_prefix_cache_hits_total', 0):.0f} "
          f"({last.metrics.get('mlx_gateway_prefix_cache_tokens_total', 0):.0f} tokens); "
          f"{len(error_lines)} ERROR lines in the log")  # fmt: skip
    print("criteria:")
    print_criteria(criteria)
    bad = [o for o in outcomes if o.verdict in (kinds.INVALID, kinds.SERVER_ERROR, kinds.LOST)]
    for o in bad[:10]:
        print(f"  {o.verdict} {o.kind} ({o.status}): {o.detail}")
    for line in error_lines[:5]:
        print(f"  log: {line[:200]}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "outcomes": [asdict(o) for o in outcomes],
            "samples": [asdict(s) for s in monitor.samples],
            "caches": cache_stats,
            "criteria": [asdict(c) for c in criteria],
        }, indent=1))  # fmt: skip
    passed = all(c.ok for c in criteria)
    print("soak:", "PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
