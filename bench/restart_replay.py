"""The agent replay across a server restart: does the prefix cache survive it?

bench/agent_replay.py's workload (interleaved agent conversations that resend their whole
history every turn) runs its first half of turns against a fresh server, the server is
stopped with SIGTERM (a clean shutdown, which writes the live and paged-out prefixes to the
disk tier) and started again, and the second half of the turns runs against the new
process. Two variants, one after the other on this 2-core machine:

  gateway-disk     `--prefix-cache-dir DIR`: the second process rebuilds its trie from DIR
  gateway-memory   the default (no disk tier): the second process starts cold

Reported: the second half's total time to first token for each variant and their ratio
(target <= 0.3x), the tokens each reused, and the disk tier's restore rate (seconds per GB
of snapshot read back, from /debug/prefix-cache's disk_load_us and disk_loaded_bytes).

    python bench/restart_replay.py [--model smollm2-135m] [--conversations 3] [--turns 4]
                                   [--system-tokens 2000] [--max-tokens 20] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench._servers import _free_port, _gateway_spec, running  # noqa: E402
from bench.agent_replay import (  # noqa: E402
    Accountant,
    Transcript,
    TurnResult,
    Workload,
    _find_fixture,
    replay,
    system_text,
)

TARGET_DISK_VS_MEMORY = 0.3


@dataclass(frozen=True)
class Variant:
    name: str
    first: tuple[TurnResult, ...]
    second: tuple[TurnResult, ...]
    disk: dict[str, int]

    @property
    def second_ttft(self) -> float:
        return sum(t.ttft for t in self.second)

    @property
    def second_reused(self) -> int:
        return sum(t.reused or 0 for t in self.second)


def _disk_stats(base: str) -> dict[str, int]:
    body = httpx.get(base + "/debug/prefix-cache", timeout=30.0).json()
    stats = body.get("stats", {})
    return {k: int(v) for k, v in stats.items() if k.startswith("disk_") and isinstance(v, int)}


def run_variant(
    name: str, model: str, extra: Sequence[str], work: Workload, acct: Accountant, logdir: Path
) -> Variant:
    """The first half against one server, the second half against its restart."""
    port = _free_port()
    spec = _gateway_spec("gateway", model, port)
    spec = replace(spec, name=name, note=" ".join(extra) or "no disk tier", cmd=(*spec.cmd, *extra))
    turns = work.order()
    half = work.turns // 2
    first_pairs = [(c, t) for c, t in turns if t < half]
    second_pairs = [(c, t) for c, t in turns if t >= half]
    transcript = Transcript.start(work)
    print(f"[{name}] first half: {len(first_pairs)} turns", file=sys.stderr, flush=True)
    with running(spec, port, logdir / f"{name}-1.log") as base:
        first = replay(base, spec, work, acct, logdir / f"{name}-1.log", first_pairs, transcript)
    # `running` ends the server with SIGTERM: a clean shutdown that flushes the disk tier
    print(
        f"[{name}] restarted; second half: {len(second_pairs)} turns", file=sys.stderr, flush=True
    )
    with running(spec, port, logdir / f"{name}-2.log") as base:
        second = replay(base, spec, work, acct, logdir / f"{name}-2.log", second_pairs, transcript)
        disk = _disk_stats(base)
    return Variant(name, tuple(first), tuple(second), disk)


def _print(variants: Sequence[Variant]) -> None:
    print(
        "| variant | first half total TTFT s | second half total TTFT s | second half reused tok "
        "| second half reusable tok | disk loads | disk GB read | restore s/GB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        gb = v.disk.get("disk_loaded_bytes", 0) / 1e9
        rate = f"{v.disk.get('disk_load_us', 0) / 1e6 / gb:.2f}" if gb else "n/a"
        loads = v.disk.get("disk_loads", "n/a")
        print(
            f"| {v.name} | {sum(t.ttft for t in v.first):.2f} | {v.second_ttft:.2f} "
            f"| {v.second_reused} | {sum(t.reusable for t in v.second)} | {loads} "
            f"| {gb:.3f} | {rate} |"
        )
    by = {v.name: v for v in variants}
    disk, memory = by.get("gateway-disk"), by.get("gateway-memory")
    print("\nper request of the second half: TTFT s (reused / reusable)")
    print("| conv | turn | prompt tok | " + " | ".join(v.name for v in variants) + " |")
    print("|---:|---:|---:|" + "---:|" * len(variants))
    for i, t in enumerate(variants[0].second):
        cells = [
            f"{v.second[i].ttft:.3f} ({v.second[i].reused}/{v.second[i].reusable})"
            for v in variants
        ]
        print(f"| {t.conv + 1} | {t.turn + 1} | {t.prompt_tokens} | " + " | ".join(cells) + " |")
    if disk and memory and memory.second_ttft > 0:
        ratio = disk.second_ttft / memory.second_ttft
        verdict = "PASS" if ratio <= TARGET_DISK_VS_MEMORY else "FAIL"
        print(
            f"\n- second-half TTFT, disk tier / no disk tier: {ratio:.3f} "
            f"(target <= {TARGET_DISK_VS_MEMORY}) {verdict}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="store alias (a GGUF)")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=4, help="split in half around the restart")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--fixture", default=None, help="client request JSON (see agent_replay)")
    p.add_argument(
        "--quick", action="store_true", help="2 conversations x 2 turns, 600-token system"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.system_tokens, args.max_tokens = 2, 2, 600, 8
    if args.turns < 2:
        p.error("--turns must be at least 2 (half before the restart, half after)")
    from gateway.cli.store.store import Store

    gguf = Store().resolve(args.model)
    acct = Accountant(gguf)
    fixture = _find_fixture(args.fixture)
    work = Workload(
        system_text(acct, fixture, args.system_tokens),
        args.conversations,
        args.turns,
        args.max_tokens,
    )
    logdir = Path(tempfile.mkdtemp(prefix="restart_replay_"))  # kept: the servers' logs
    cache_dir = Path(tempfile.mkdtemp(prefix="restart_replay_cache_"))
    variants = []
    try:
        for name, extra in (
            ("gateway-disk", ("--prefix-cache-dir", str(cache_dir))),
            ("gateway-memory", ()),
        ):
            variants.append(run_variant(name, args.model, extra, work, acct, logdir))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print(
        f"\n{args.model}: {args.conversations} conversations x {args.turns} turns interleaved, "
        f"restart after turn {args.turns // 2}, system prompt + tools {acct.count(work.system)} "
        f"tokens ({fixture.name if fixture else 'synthetic'}), {args.max_tokens} new tokens per "
        f"turn, greedy, streaming; logs in {logdir}\n"
    )
    _print(variants)


if __name__ == "__main__":
    main()
