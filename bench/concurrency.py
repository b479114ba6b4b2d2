"""Concurrent streams: the gateway's continuous batching against mlx-lm's, in one run.

Two measurements (issue 11), each server in its own process on 127.0.0.1:

1. Throughput. N concurrent streaming chat completions (N = --streams, default
   1,2,4,8,16), each a different short prompt asking for a long story, --gen-tokens new
   tokens, greedy. Aggregate completion tokens/s (usage tokens summed over wall time from
   the first submit to the last finish) and the ratio to one stream, for:
     gateway          `mlx-gateway serve --max-batch 16` (float32 + optimized BLAS)
     gateway-nobatch  the same with `--max-batch 1` (batching off), for reference
     mlx-lm           `mlx_lm.server --decode-concurrency 16 --prompt-concurrency 16` on
                      the same float32 weights with the same BLAS preloaded
   Targets: gateway at 8 streams >= 4x its 1 stream; gateway >= 1.0x mlx-lm at each N.
2. Interference (gateway, prefix cache off so every prompt is computed in full): four
   streams decode continuously (each loops requests) while one long prompt
   (--long-tokens of synthetic code) arrives. The streams' inter-token latency (gaps
   between content chunks) p50 / p95 before it arrives and while it is being read, and
   the long prompt's time to first token against the same prompt sent alone.
   Targets: p95 during <= 3x p95 unloaded; long TTFT <= 1.5x its solo TTFT.

    python bench/concurrency.py [--models smollm2-135m qwen2.5-coder-0.5b]
        [--streams 1,2,4,8,16] [--gen-tokens 128] [--long-tokens 16384]
        [--skip-mlx] [--skip-interference] [--json out.json]

The interference part uses the last model given (its context must hold --long-tokens;
SmolLM2's is 8k). The machine is shared: absolute numbers are noise, the ratios measured
in the same run are the result.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._servers import ServerSpec, _free_port, _mlx_spec, _one_line, running  # noqa: E402

TOPICS = (
    "a dragon", "a robot", "the sea", "a city at night", "a mountain village", "a chef",
    "a pilot", "an old forest", "the moon", "a violin maker", "a desert caravan",
    "a clockmaker", "a library", "a long winter", "a night train", "a secret garden",
)  # fmt: skip


def _gateway(alias: str, port: int, *extra: str) -> ServerSpec:
    cmd = [sys.executable, "-m", "gateway.cli.main", "serve", "--model", alias]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *extra]
    return ServerSpec("gateway " + " ".join(extra), "", tuple(cmd), alias, "/health")


def _chat(base: str, model: str, prompt: str, max_tokens: int) -> tuple[int, list[float]]:
    """Stream one chat completion; (completion tokens, arrival time of each content chunk)."""
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    arrivals: list[float] = []
    tokens = 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                arrivals.append(time.perf_counter())
    return tokens or len(arrivals), arrivals


def throughput(base: str, model: str, n: int, gen: int) -> float:
    """Aggregate completion tokens/s of n concurrent streams."""
    counts = [0] * n
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            prompt = f"Write a long story about {TOPICS[i % len(TOPICS)]}. Story {i}:"
            counts[i] = _chat(base, model, prompt, gen)[0]
        except Exception as exc:  # reported in the table
            errors.append(_one_line(exc))

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    return sum(counts) / (time.perf_counter() - start)


@dataclass
class ServerRow:
    name: str
    model: str
    tps: dict[int, float] = field(default_factory=dict)
    error: str | None = None


def bench_throughput(
    spec: ServerSpec, port: int, streams: Sequence[int], gen: int, logs: Path, model: str
) -> ServerRow:
    row = ServerRow(spec.name, model)
    try:
        with running(spec, port, logs / f"{spec.name.replace(' ', '_')}.log") as base:
            throughput(base, spec.model, 1, 8)  # warm up
            for n in streams:
                row.tps[n] = throughput(base, spec.model, n, gen)
                print(f"  {spec.name}: {n} streams {row.tps[n]:.1f} tok/s", flush=True)
    except Exception as exc:
        row.error = _one_line(exc)
        print(f"  {spec.name}: FAILED {row.error}", flush=True)
    return row


def _long_prompt(tokens: int, tag: str) -> str:
    # about 18 tokens a function with Qwen's tokenizer; `tag` makes each prompt unique
    lines = [f"# {tag}: what do these functions compute?"]
    lines += [f"def f{i}(x):\n    return x * {i} + {i * i % 97}" for i in range(tokens // 18)]
    return "\n".join(lines)


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[int(q * (len(s) - 1))] if s else float("nan")


@dataclass
class Interference:
    unloaded_p50: float
    unloaded_p95: float
    during_p50: float
    during_p95: float
    long_ttft: float
    solo_ttft: float
    long_prompt_tokens: int


def interference(base: str, model: str, long_tokens: int) -> Interference:
    stop = threading.Event()
    gaps_before: list[float] = []
    gaps_during: list[float] = []
    window: list[float] = [float("inf"), float("inf")]  # the long prompt: sent, first token

    def stream(i: int) -> None:
        while not stop.is_set():
            _, arrivals = _chat(base, model, f"Write a long story about {TOPICS[i]}.", 200)
            for a, b in itertools.pairwise(arrivals):
                if a < window[0]:
                    gaps_before.append(b - a)
                elif a < window[1]:
                    gaps_during.append(b - a)

    solo_start = time.perf_counter()
    solo_tokens, solo = _chat(base, model, _long_prompt(long_tokens, "solo"), 1)
    solo_ttft = solo[0] - solo_start if solo else float("nan")
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(20)  # the streams reach their steady state
    window[0] = time.perf_counter()
    _, first = _chat(base, model, _long_prompt(long_tokens, "loaded"), 1)
    window[1] = first[0] if first else time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    prompt_tokens = long_tokens  # requested size; the usage below is informative only
    del solo_tokens
    return Interference(
        _quantile(gaps_before, 0.5), _quantile(gaps_before, 0.95),
        _quantile(gaps_during, 0.5), _quantile(gaps_during, 0.95),
        window[1] - window[0], solo_ttft, prompt_tokens,
    )  # fmt: skip


def _print_throughput(rows: Sequence[ServerRow], streams: Sequence[int]) -> None:
    head = "| server | model | " + " | ".join(f"{n} streams" for n in streams) + " | 8 vs 1 |"
    print(head)
    print("|" + "---|" * (len(streams) + 3))
    for r in rows:
        if r.error:
            print(f"| {r.name} | {r.model} | {r.error} |")
            continue
        one = r.tps.get(1)
        cells = [
            f"{r.tps[n]:.1f} tok/s" + (f" ({r.tps[n] / one:.2f}x)" if one and n != 1 else "")
            for n in streams if n in r.tps
        ]  # fmt: skip
        eight = f"{r.tps[8] / one:.2f}x" if one and 8 in r.tps else "-"
        print(f"| {r.name} | {r.model} | " + " | ".join(cells) + f" | {eight} |")
    for model in dict.fromkeys(r.model for r in rows):
        gw = next(
            (r for r in rows if r.model == model and r.name.strip() == "gateway --max-batch 16"),
            None,
        )
        peer = next((r for r in rows if r.model == model and r.name == "mlx-lm"), None)
        if gw and peer and not gw.error and not peer.error:
            ratios = ", ".join(
                f"{n}: {gw.tps[n] / peer.tps[n]:.2f}x"
                for n in streams
                if n in gw.tps and n in peer.tps
            )
            print(f"\n{model}: gateway / mlx-lm at each N: {ratios} (target >= 1.0x)")
        if gw and not gw.error and 1 in gw.tps and 8 in gw.tps:
            print(f"{model}: gateway 8 streams vs 1: {gw.tps[8] / gw.tps[1]:.2f}x (target >= 4x)")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--streams", default="1,2,4,8,16")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--skip-mlx", action="store_true")
    p.add_argument("--skip-interference", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="concurrency_"))
    rows: list[ServerRow] = []
    for model in args.models:
        for extra in (("--max-batch", "16"), ("--max-batch", "1")):
            port = _free_port()
            spec = _gateway(model, port, *extra)
            rows.append(bench_throughput(spec, port, streams, args.gen_tokens, logs, model))
        if not args.skip_mlx:
            rows.append(_mlx_row(model, streams, args.gen_tokens, logs))
    result: dict[str, Any] = {"throughput": [asdict(r) for r in rows]}
    inter = None
    if not args.skip_interference:
        model = args.models[-1]
        port = _free_port()
        spec = _gateway(model, port, "--max-batch", "16", "--prefix-cache-bytes", "0")
        with running(spec, port, logs / "interference.log") as base:
            inter = interference(base, model, args.long_tokens)
        result["interference"] = asdict(inter)
    print(
        f"\n{args.gen_tokens} greedy tokens a stream, streaming chat completions; logs in {logs}\n"
    )
    _print_throughput(rows, streams)
    if inter is not None:
        i = inter
        print(
            f"\nInterference ({args.models[-1]}, 4 streams, a {args.long_tokens}-token prompt arrives):"
        )
        print("| | p50 ITL | p95 ITL |\n|---|---:|---:|")
        print(f"| unloaded | {i.unloaded_p50 * 1000:.0f} ms | {i.unloaded_p95 * 1000:.0f} ms |")
        print(
            f"| while the long prompt is read | {i.during_p50 * 1000:.0f} ms | {i.during_p95 * 1000:.0f} ms |"
        )
        print(
            f"| ratio | {i.during_p50 / i.unloaded_p50:.2f}x | {i.during_p95 / i.unloaded_p95:.2f}x (target <= 3x) |"
        )
        print(
            f"long prompt TTFT {i.long_ttft:.1f} s vs alone {i.solo_ttft:.1f} s: "
            f"{i.long_ttft / i.solo_ttft:.2f}x (target <= 1.5x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def _mlx_row(model: str, streams: Sequence[int], gen: int, logs: Path) -> ServerRow:
    from bench.agent_replay import Accountant, mlx_folder
    from gateway.cli.store import Store

    try:
        gguf = Store().resolve(model)
        folder = mlx_folder(gguf, model, Accountant(gguf))
        port = _free_port()
        spec = _mlx_spec(folder, port, 16)
        code = spec.cmd[-1].replace(
            "'--log-level', 'WARNING'",
            "'--log-level', 'WARNING', '--decode-concurrency', '16', '--prompt-concurrency', '16'",
        )
        spec = ServerSpec("mlx-lm", "", (*spec.cmd[:-1], code), spec.model, spec.ready_path)
    except Exception as exc:
        return ServerRow("mlx-lm", model, error=_one_line(exc))
    return bench_throughput(spec, port, streams, gen, logs, model)


if __name__ == "__main__":
    main()
