"""bench/concurrency.py's tables and verdicts against issue 11's targets."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.concurrency import Interference, ServerRow

STREAMS_LOADED = 4  # streams decoding while the long prompt arrives
TARGET_SCALING = 4.0  # gateway at 8 streams vs 1
TARGET_VS_MLX = 1.0
TARGET_ITL = 3.0
TARGET_TTFT = 1.5


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _table_row(label: str, cells: Sequence[str]) -> str:
    return f"| {label} | " + " | ".join(cells) + " |"


def _server_rows(r: ServerRow, streams: Sequence[int], ref: ServerRow | None) -> list[str]:
    if r.error:
        return [_table_row(r.name, [f"FAILED: {r.error}"] + [""] * (len(streams) - 1))]
    one = r.rounds[1].tps if 1 in r.rounds else None
    tps = [
        f"{r.rounds[n].tps:.1f}" + (f" ({_ratio(r.rounds[n].tps, one)})" if n != 1 else "")
        if n in r.rounds else "-"
        for n in streams
    ]  # fmt: skip
    lines = [_table_row(f"{r.name} tok/s", tps)]
    toks = [f"{sum(r.rounds[n].tokens) / n:.0f}" if n in r.rounds else "-" for n in streams]
    lines.append(_table_row("  tokens/stream", toks))
    if any(g.max_running is not None for g in r.rounds.values()):
        lines.append(_table_row("  largest batch seen", [
            str(r.rounds[n].max_running) if n in r.rounds else "-" for n in streams
        ]))  # fmt: skip
    if ref is not None and ref is not r and not ref.error and ref.rounds:
        texts = ref.rounds[max(ref.rounds)].texts
        same = []
        for n in streams:
            got = r.rounds.get(n)
            k = sum(t == texts[i] for i, t in enumerate(got.texts) if i < len(texts)) if got else 0
            same.append(f"{k}/{n}" if got else "-")
        lines.append(_table_row("  same text as --max-batch 1", same))
    return lines


def _targets(gw: ServerRow | None, peer: ServerRow | None, streams: Sequence[int]) -> list[str]:
    out = []
    if gw and not gw.error and 1 in gw.rounds and 8 in gw.rounds:
        x = gw.rounds[8].tps / gw.rounds[1].tps
        verdict = "PASS" if x >= TARGET_SCALING else "FAIL"
        out.append(f"gateway 8 streams vs 1: {x:.2f}x (target >= {TARGET_SCALING:.0f}x) {verdict}")
    if gw and peer and not gw.error and not peer.error:
        common = [n for n in streams if n in gw.rounds and n in peer.rounds]
        xs = {n: gw.rounds[n].tps / peer.rounds[n].tps for n in common}
        if xs:
            worst = min(xs, key=lambda n: xs[n])
            verdict = "PASS" if xs[worst] >= TARGET_VS_MLX else "FAIL"
            out.append(
                f"gateway vs mlx-lm at every N: lowest {xs[worst]:.2f}x at {worst} streams "
                f"(target >= {TARGET_VS_MLX:.1f}x) {verdict}"
            )
    return out


def print_throughput(rows: Sequence[ServerRow], streams: Sequence[int], gen: int) -> None:
    for alias in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == alias]
        ref = next((r for r in mine if r.name == "gateway --max-batch 1"), None)
        gw = next((r for r in mine if r.name == "gateway"), None)
        peer = next((r for r in mine if r.name == "mlx-lm"), None)
        print(f"\n### Throughput, {alias}: aggregate completion tokens/s, {gen} greedy tokens "
              "a stream (ratio to 1 stream)\n")  # fmt: skip
        print(_table_row("server", [f"{n} stream{'s' * (n > 1)}" for n in streams]))
        print("|---|" + "---:|" * len(streams))
        for r in sorted(mine, key=lambda r: ("gateway", "gateway --max-batch 1").index(r.name)
                        if r.name.startswith("gateway") else 2):  # fmt: skip
            for line in _server_rows(r, streams, ref):
                print(line)
        if gw and peer and not gw.error and not peer.error:
            print(_table_row("gateway / mlx-lm", [
                _ratio(gw.rounds[n].tps, peer.rounds[n].tps)
                if n in gw.rounds and n in peer.rounds else "-"
                for n in streams
            ]))  # fmt: skip
        print()
        for line in _targets(gw, peer, streams):
            print(line)
        for r in mine:
            print(f"{r.name}: {r.note or 'defaults'}; log {r.log}")


def _ms(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x == x else "-"


def print_interference(rows: Sequence[Interference], long_tokens: int) -> None:
    alias = rows[0].model
    sys.stdout.flush()
    print(f"\n### Interference, {alias}: {STREAMS_LOADED} streams decoding while a "
          f"{long_tokens}-token prompt arrives (prefix cache off)\n")  # fmt: skip
    print(_table_row("", [r.server for r in rows]))
    print("|---|" + "---:|" * len(rows))
    if any(r.error for r in rows):
        print(_table_row("error", [r.error or "" for r in rows]))
    table: list[tuple[str, Callable[[Interference], str]]] = [
        ("streams' ITL p50, unloaded", lambda r: _ms(r.unloaded.get("p50", float("nan")))),
        ("  during the long prefill", lambda r: _ms(r.during.get("p50", float("nan")))),
        ("  ratio", lambda r: _ratio(r.during.get("p50"), r.unloaded.get("p50"))),
        ("streams' ITL p95, unloaded", lambda r: _ms(r.unloaded.get("p95", float("nan")))),
        ("  during the long prefill", lambda r: _ms(r.during.get("p95", float("nan")))),
        (f"  ratio (target <= {TARGET_ITL:.0f}x)",
         lambda r: _ratio(r.during.get("p95"), r.unloaded.get("p95"))),
        ("longest gap during", lambda r: _ms(r.during.get("max", float("nan")))),
        ("gaps counted, unloaded / during",
         lambda r: f"{r.unloaded.get('n', 0):.0f} / {r.during.get('n', 0):.0f}"),
        ("stream requests queued behind it (longest wait)",
         lambda r: f"{len(r.waits)} ({max(r.waits):.1f} s)" if r.waits else "0"),
        ("long prompt tokens (usage)", lambda r: str(r.long_prompt_tokens or "-")),
        ("long prompt TTFT alone", lambda r: f"{r.solo_ttft:.1f} s"),
        (f"  with {STREAMS_LOADED} streams", lambda r: f"{r.loaded_ttft:.1f} s"),
        (f"  ratio (target <= {TARGET_TTFT}x)", lambda r: _ratio(r.loaded_ttft, r.solo_ttft)),
    ]  # fmt: skip
    for label, cell in table:
        print(_table_row(label, [cell(r) for r in rows]))
    gw = next((r for r in rows if r.server == "gateway" and not r.error), None)
    if gw:
        itl = gw.during.get("p95", float("nan")) / gw.unloaded.get("p95", float("nan"))
        ttft = gw.loaded_ttft / gw.solo_ttft
        print(f"\ngateway p95 ITL during / unloaded: {itl:.2f}x (target <= {TARGET_ITL:.0f}x) "
              f"{'PASS' if itl <= TARGET_ITL else 'FAIL'}")  # fmt: skip
        print(f"gateway long TTFT with streams / alone: {ttft:.2f}x (target <= {TARGET_TTFT}x) "
              f"{'PASS' if ttft <= TARGET_TTFT else 'FAIL'}")  # fmt: skip
    for r in rows:
        print(f"{r.server}: log {r.log}")
    sys.stdout.flush()
