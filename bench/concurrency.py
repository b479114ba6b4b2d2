"""Concurrent streams: the gateway's continuous batching against mlx-lm's, in one run (issue 11).

Every server runs in its own process on 127.0.0.1, one at a time, and is stopped after.

1. Throughput. For each model (--models), N concurrent streaming chat completions
   (N = --streams, default 1,2,4,8,16; one thread and one httpx stream each), each a
   different short prompt asking for a long story, --gen-tokens new tokens, temperature 0.
   Aggregate completion tokens/s = the usage completion tokens of all N summed, over the
   wall time from the first submit to the last finish; and its ratio to one stream. Servers:
     gateway --max-batch 1   `mlx-gateway serve --max-batch 1` (batching off), the reference
                             every other server's texts are compared with
     gateway                 `mlx-gateway serve --max-batch 16`
     mlx-lm                  `mlx_lm.server --decode-concurrency 16 --prompt-concurrency 16`
                             on our loader's float32 weights with the same BLAS preloaded
   Also shown: mean completion tokens per stream, the largest batch the gateway's /health
   reported while the round ran, and how many streams wrote exactly the text the
   gateway --max-batch 1 wrote for the same prompt (greedy; batched float32 sums may
   legitimately round differently, so this is a sanity check, not a target).
   Targets: gateway at 8 streams >= 4x its 1 stream; gateway >= 1.0x mlx-lm at each N.

2. Interference (the last model of --models; its context must hold --long-tokens, and
   SmolLM2's is 8k). Four streams decode the whole time (each loops requests and is cut
   off by closing its connection at the end) while one long prompt of Python source
   (--long-tokens, max_tokens 1) arrives. The streams' inter-token latency -- gaps between
   SSE chunks that carry content, within one request -- p50 / p95 over at least 15 s (and
   120 gaps) of steady decoding before it arrives ("unloaded") and over the gaps that
   overlap its prefill (from its submit to its first token, "during"); and its time to
   first token against the same prompt, but for its first words, sent alone beforehand.
   The gateway runs with --prefix-cache-bytes 0 and every long prompt starts with a
   unique tag, so both the solo and the loaded one are computed in full.
   Stream requests that started while the long prompt was being read wait for it (one
   prefill at a time); their count and longest wait are shown too.
   Targets: p95 during <= 3x p95 unloaded; long TTFT with the streams <= 1.5x alone.
   mlx-lm is measured the same way unless --skip-mlx or --skip-mlx-interference.

    python bench/concurrency.py [--models smollm2-135m qwen2.5-coder-0.5b]
        [--streams 1,2,4,8,16] [--gen-tokens 128] [--long-tokens 16384]
        [--skip-mlx] [--skip-throughput] [--skip-interference] [--skip-mlx-interference]
        [--skip-unbatched]
        [--json out.json]

Models come from `mlx-gateway pull ALIAS`. The machine may be shared: absolute numbers are
noise, the ratios measured in the same run are the result.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench._concurrency_report import (  # noqa: E402
    STREAMS_LOADED,
    print_interference,
    print_throughput,
)
from bench._servers import (  # noqa: E402
    ServerSpec,
    _free_port,
    _log_tail,
    _mlx_spec,
    _one_line,
    running,
)

TOPICS = (
    "a dragon", "a robot", "the sea", "a city at night", "a mountain village", "a chef",
    "a pilot", "an old forest", "the moon", "a violin maker", "a desert caravan",
    "a clockmaker", "a library", "a long winter", "a night train", "a secret garden",
)  # fmt: skip
BATCH = 16  # the gateway's --max-batch and mlx-lm's concurrency options
MLX_BATCHING = ("--decode-concurrency", str(BATCH), "--prompt-concurrency", str(BATCH))
REQUEST_TIMEOUT_S = 3600.0
STREAM_MAX_TOKENS = 4096  # interference streams are cut off by closing, not by this
UNLOADED_S = 15.0  # seconds of steady decoding measured before the long prompt, at least
UNLOADED_GAPS = 120  # ... and until this many gaps are in (120 s at most)
SETTLE_S = 3.0  # after every stream's first token, before the unloaded window opens


def story(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"Write a long, detailed story about {topic}, at least a thousand words, "
        f"with many characters, places and events. Story number {i + 1}."
    )


# ---------------------------------------------------------------- one stream
@dataclass
class Reply:
    sent: float
    first: float | None = None  # first chunk with content or a finish reason
    arrivals: list[float] = field(default_factory=list)  # chunks that carry content
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


def chat(
    base: str, model: str, prompt: str, max_tokens: int,
    stop: threading.Event | None = None, live: list[Reply] | None = None,
) -> Reply:  # fmt: skip
    """One streaming chat completion. `stop` set: close the connection at the next chunk
    (the server cancels). `live`: the reply is appended there before it is sent, so another
    thread can watch its arrivals."""
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    reply = Reply(time.perf_counter())
    if live is not None:
        live.append(reply)
    parts: list[str] = []
    url = f"{base}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if stop is not None and stop.is_set():
                break
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            _take(json.loads(line[6:]), time.perf_counter(), reply, parts)
    reply.text = "".join(parts)
    reply.completion_tokens = reply.completion_tokens or len(reply.arrivals)
    return reply


def _take(chunk: dict[str, Any], now: float, reply: Reply, parts: list[str]) -> None:
    if "error" in chunk:
        raise RuntimeError(f"error in the stream: {json.dumps(chunk)[:300]}")
    usage = chunk.get("usage")
    if usage:
        reply.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        reply.completion_tokens = int(usage.get("completion_tokens") or 0)
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            reply.arrivals.append(now)
            parts.append(content)
        if reply.first is None and (content or choice.get("finish_reason")):
            reply.first = now


# ---------------------------------------------------------------- throughput
@dataclass
class Round:
    """N concurrent streams."""

    n: int
    seconds: float
    tokens: list[int]
    texts: list[str]
    max_running: int | None  # the largest batch /health reported (the gateway only)

    @property
    def tps(self) -> float:
        return sum(self.tokens) / self.seconds


class _HealthWatch:
    """Polls the gateway's /health while a round runs: the largest `running` seen."""

    def __init__(self, base: str) -> None:
        self.base, self.peak, self.ok = base, 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.wait(0.25):
                try:
                    running = client.get(self.base + "/health").json().get("running")
                except (httpx.HTTPError, ValueError):
                    continue
                if isinstance(running, int):
                    self.peak, self.ok = max(self.peak, running), True

    def __enter__(self) -> _HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_round(base: str, model: str, n: int, gen: int, watch: bool) -> Round:
    replies: list[Reply | None] = [None] * n
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            replies[i] = chat(base, model, story(i), gen)
        except Exception as exc:  # every failure is reported
            errors.append(f"stream {i}: {_one_line(exc)}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    with _HealthWatch(base) as health:
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed; {errors[0]}")
    done = [r for r in replies if r is not None]
    peak = health.peak if watch and health.ok else None
    return Round(n, seconds, [r.completion_tokens for r in done], [r.text for r in done], peak)


@dataclass
class ServerRow:
    name: str
    model: str
    note: str
    rounds: dict[int, Round] = field(default_factory=dict)
    error: str | None = None
    log: str = ""


def bench_throughput(
    spec: ServerSpec, port: int, alias: str, streams: Sequence[int], gen: int, logs: Path
) -> ServerRow:
    log = logs / f"{alias}-{spec.name.replace(' ', '_')}.log"
    row = ServerRow(spec.name, alias, spec.note, log=str(log))
    print(f"[{alias} {spec.name}] starting, log {log}", file=sys.stderr, flush=True)
    try:
        with running(spec, port, log) as base:
            run_round(base, spec.model, 1, 8, watch=False)  # warm up
            for n in streams:
                got = run_round(base, spec.model, n, gen, watch=spec.name.startswith("gateway"))
                row.rounds[n] = got
                print(
                    f"[{alias} {spec.name}] {n} streams: {got.tps:.1f} tok/s, "
                    f"{sum(got.tokens)} tokens in {got.seconds:.1f} s",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
    except Exception as exc:  # reported in the table; the next server still runs
        row.error = _one_line(exc)
        print(f"[{alias} {spec.name}] FAILED: {exc}\n{_log_tail(log, 3000)}", file=sys.stderr)
    return row


# ---------------------------------------------------------------- interference
@dataclass
class Interference:
    server: str
    model: str
    long_prompt_tokens: int = 0
    solo_ttft: float = float("nan")
    loaded_ttft: float = float("nan")
    unloaded: dict[str, float] = field(default_factory=dict)  # p50, p95, max, n
    during: dict[str, float] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)  # stream requests queued behind it
    error: str | None = None
    log: str = ""


def _quantile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _gap_stats(replies: Sequence[Reply], keep: Callable[[float, float], bool]) -> dict[str, float]:
    gaps = [b - a for r in replies for a, b in itertools.pairwise(r.arrivals) if keep(a, b)]
    return {
        "p50": _quantile(gaps, 0.5), "p95": _quantile(gaps, 0.95),
        "max": max(gaps, default=float("nan")), "n": float(len(gaps)),
    }  # fmt: skip


def _wait_streaming(live: Sequence[list[Reply]], errors: list[str]) -> None:
    """Until every stream has its first token."""
    deadline = time.perf_counter() + 600.0
    while not all(rs and rs[0].arrivals for rs in live):
        if errors:
            raise RuntimeError(errors[0])
        if time.perf_counter() > deadline:
            raise RuntimeError("the streams did not start within 600 s")
        time.sleep(0.1)


def _wait_unloaded(live: Sequence[list[Reply]], steady: float) -> None:
    """At least UNLOADED_S seconds after `steady`, and UNLOADED_GAPS gaps (or 120 s)."""
    while True:
        time.sleep(0.5)
        now = time.perf_counter()
        gaps = sum(sum(a >= steady for a in r.arrivals[:-1]) for rs in live for r in list(rs))
        if now >= steady + 120.0 or (now >= steady + UNLOADED_S and gaps >= UNLOADED_GAPS):
            return


def measure_interference(
    base: str, model: str, prompts: tuple[str, str], out: Interference
) -> None:
    """Fills `out`; prompts = (solo, loaded): the same size, different first tokens."""
    chat(base, model, "Say hello.", 8)  # warm up
    solo = chat(base, model, prompts[0], 1)
    assert solo.first is not None, "the solo long prompt gave no token"
    out.solo_ttft, out.long_prompt_tokens = solo.first - solo.sent, solo.prompt_tokens
    print(f"[{out.server}] long prompt alone: TTFT {out.solo_ttft:.1f} s", file=sys.stderr)
    stop = threading.Event()
    live: list[list[Reply]] = [[] for _ in range(STREAMS_LOADED)]
    errors: list[str] = []

    def loop(i: int) -> None:
        try:
            while not stop.is_set():
                chat(base, model, story(i), STREAM_MAX_TOKENS, stop, live[i])
        except Exception as exc:  # every failure is reported
            errors.append(f"stream {i}: {_one_line(exc)}")

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(STREAMS_LOADED)]
    for t in threads:
        t.start()
    try:
        _wait_streaming(live, errors)
        steady = time.perf_counter() + SETTLE_S
        _wait_unloaded(live, steady)
        loaded = chat(base, model, prompts[1], 1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    if errors:
        raise RuntimeError(errors[0])
    assert loaded.first is not None, "the loaded long prompt gave no token"
    w0, w1 = loaded.sent, loaded.first
    out.loaded_ttft = w1 - w0
    replies = [r for rs in live for r in rs]
    out.unloaded = _gap_stats(replies, lambda a, b: a >= steady and b <= w0)
    out.during = _gap_stats(replies, lambda a, b: b > w0 and a < w1)
    # stream requests whose first token came after the long prompt was sent
    out.waits = [r.first - r.sent for r in replies if r.first and r.first > w0 and r.sent < w1]


def long_prompts(alias: str, n_tokens: int) -> tuple[str, str]:
    """Two user messages of Python source, each about `n_tokens` tokens once rendered
    (the chat template's few tokens aside), differing from their first words on."""
    from bench._long_prompts import _code_text
    from bench.agent_replay import Accountant
    from gateway.cli.store.store import Store

    acct = Accountant(Store().resolve(alias))
    head = "Read this code and explain in a few sentences what each part does.\n\n"
    body = acct.cut(_code_text(6 * n_tokens), max(n_tokens - 64, 1))
    return (f"[solo run] {head}{body}", f"[run with streams] {head}{body}")


def bench_interference(spec: ServerSpec, port: int, alias: str, prompts: tuple[str, str],
                       logs: Path) -> Interference:  # fmt: skip
    log = logs / f"{alias}-interference-{spec.name.replace(' ', '_')}.log"
    out = Interference(spec.name, alias, log=str(log))
    print(f"[interference {spec.name}] starting, log {log}", file=sys.stderr, flush=True)
    try:
        with running(spec, port, log) as base:
            measure_interference(base, spec.model, prompts, out)
    except Exception as exc:  # reported in the table
        out.error = _one_line(exc)
        print(f"[interference {spec.name}] FAILED: {exc}\n{_log_tail(log, 3000)}",
              file=sys.stderr)  # fmt: skip
    return out


# ---------------------------------------------------------------- servers
def gateway_spec(alias: str, port: int, name: str, *extra: str) -> ServerSpec:
    cmd = [sys.executable, "-m", "gateway.cli.main", "serve", "--model", alias]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *extra]
    return ServerSpec(name, " ".join(extra), tuple(cmd), alias, "/health")


def mlx_spec(alias: str, port: int) -> ServerSpec:
    from bench.agent_replay import Accountant, mlx_folder
    from gateway.cli.store.store import Store

    gguf = Store().resolve(alias)
    spec = _mlx_spec(mlx_folder(gguf, alias, Accountant(gguf)), port, BATCH, MLX_BATCHING)
    return ServerSpec("mlx-lm", " ".join(MLX_BATCHING), spec.cmd, spec.model, spec.ready_path)


def throughput_rows(
    args: argparse.Namespace, streams: Sequence[int], logs: Path
) -> list[ServerRow]:
    rows: list[ServerRow] = []
    for alias in args.models:
        for name, extra in (
            *([] if args.skip_unbatched else [("gateway --max-batch 1", ("--max-batch", "1"))]),
            ("gateway", ("--max-batch", str(BATCH))),
        ):
            port = _free_port()
            spec = gateway_spec(alias, port, name, *extra)
            rows.append(bench_throughput(spec, port, alias, streams, args.gen_tokens, logs))
        if args.skip_mlx:
            continue
        port = _free_port()
        try:
            spec = mlx_spec(alias, port)
        except Exception as exc:  # the export failed: say so in the table
            rows.append(ServerRow("mlx-lm", alias, "", error=_one_line(exc)))
            continue
        rows.append(bench_throughput(spec, port, alias, streams, args.gen_tokens, logs))
    return rows


def interference_rows(args: argparse.Namespace, logs: Path) -> list[Interference]:
    """The gateway's (its table printed at once), then mlx-lm's (both printed again)."""
    alias = args.models[-1]
    prompts = long_prompts(alias, args.long_tokens)
    port = _free_port()
    extra = ("--max-batch", str(BATCH), "--prefix-cache-bytes", "0")
    spec = gateway_spec(alias, port, "gateway", *extra)
    out = [bench_interference(spec, port, alias, prompts, logs)]
    print_interference(out, args.long_tokens)
    if args.skip_mlx or args.skip_mlx_interference:
        return out
    port = _free_port()
    try:
        spec = mlx_spec(alias, port)
    except Exception as exc:  # the export failed: say so in the table
        return [*out, Interference("mlx-lm", alias, error=_one_line(exc))]
    out.append(bench_interference(spec, port, alias, prompts, logs))
    print_interference(out, args.long_tokens)
    return out


# ---------------------------------------------------------------- report
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--streams", default="1,2,4,8,16", help="comma-separated stream counts")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--skip-mlx", action="store_true", help="the gateway alone")
    p.add_argument("--skip-interference", action="store_true")
    p.add_argument(
        "--skip-unbatched",
        action="store_true",
        help="no --max-batch 1 row (its streams run one after another: slow); "
        "nothing then checks that batched streams write the unbatched text",
    )
    p.add_argument("--skip-throughput", action="store_true", help="interference only")
    p.add_argument("--skip-mlx-interference", action="store_true", help="mlx-lm's is slow")
    p.add_argument("--json", default=None, help="write every measurement here")
    args = p.parse_args(argv)
    streams = sorted({int(s) for s in args.streams.split(",")})
    logs = Path(tempfile.mkdtemp(prefix="concurrency_"))
    rows = [] if args.skip_throughput else throughput_rows(args, streams, logs)
    if rows:
        print_throughput(rows, streams, args.gen_tokens)  # before the long part that follows
    sys.stdout.flush()
    write_json(args, rows, [])
    if not args.skip_interference:
        write_json(args, rows, interference_rows(args, logs))


def write_json(args: argparse.Namespace, rows: Sequence[ServerRow],
               inter: Sequence[Interference]) -> None:  # fmt: skip
    if not args.json:
        return
    result = {
        "args": vars(args),
        "throughput": [asdict(r) | {"tps": {n: g.tps for n, g in r.rounds.items()}}
                       for r in rows],
        "interference": [asdict(r) for r in inter],
    }  # fmt: skip
    Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
