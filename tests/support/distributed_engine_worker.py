"""One rank of tests/runtime/distributed/test_distributed_engine.py, started on every rank by mlx.launch.

    mlx.launch -n N --backend ring ... tests/support/distributed_engine_worker.py CASES OUT

CASES holds one folder per tiny model (a checkpoint, and `reference.json`: the modes to
run and the single-process engine's results, written by the test with `serve_script`).
For each case and mode every rank loads its part with `load_sharded` and serves as
`mlx-gateway serve --distributed` does (gateway/cli/serve/distributed.py): rank 0 an Engine
whose LockstepRunner leads the group, every other rank `follow`. Rank 0 runs
`serve_script` (the same requests as the single-process run, same settings) and writes
its results; every rank writes OUT/rank<r>.json after each case, so a failure shows
how far it got. A group that cannot go on (lost, diverged) ends the process.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root holds `runtime`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runtime import backend

backend.configure()  # the optimized BLAS, before mlx is imported

import numpy as np  # noqa: E402

from runtime.distributed import Group, load_sharded  # noqa: E402
from runtime.distributed.channel import Channel  # noqa: E402
from runtime.distributed.follower import follow  # noqa: E402
from runtime.distributed.lockstep import LockstepRunner  # noqa: E402
from runtime.engine import Engine, RequestHandle  # noqa: E402
from runtime.engine.runner import ModelRunner, RunnerSettings  # noqa: E402
from runtime.models.base import fusable  # noqa: E402
from runtime.types import Finished, GenerationRequest, SamplingParams, TextDelta  # noqa: E402

# prefill chunks of 16: below the scheduler's minimum chunks, so no timing changes a
# chunk's size (and a prompt of 37 takes three); room for every state in memory; no
# drafting, as in a group (a verify step commits a batch's columns together, so what a
# finished row leaves the trie would differ by a token or two)
SETTINGS = RunnerSettings(
    prefill_chunk=16,
    prefix_cache_bytes=256 * 1024**2,
    snapshot_interval=8,
    max_batch=8,
    cache_memory_bytes=1 << 30,
    speculative="off",
)
VOCAB = 1024  # every tiny model's (tests/tiny_*.py)
TIMEOUT_S = 60.0  # the group's bound on a round: generous, the 2 cores are shared
SLOW_S = 120.0
CANCEL_AFTER = 2  # tokens the cancelled request streams before its client leaves


@dataclass(frozen=True)
class Ask:
    """One request of the script: its prompt, what it may generate, and whether its
    client goes away after CANCEL_AFTER tokens."""

    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    cancel: bool = False


def _tokens(n: int, seed: int, first: int) -> tuple[int, ...]:
    """n token ids from `first` on (no two prompts of the script start alike, so none
    shares a prefix by chance), above the special ones."""
    rng = np.random.default_rng(seed)
    return (first, *(int(t) for t in rng.integers(3, VOCAB, size=n - 1)))


LONG = _tokens(37, 1, 10)  # three prefill chunks, the first alone
SHORT = _tokens(5, 2, 11)
# submitted at once and in this order (prefills run one at a time, in order): the later
# prompts' chunks ride on the running rows' decode steps where the model fuses them
WAVE = (
    Ask("long", LONG, 8),
    Ask("short", SHORT, 10),
    # room for 400 tokens (the tiny models' 512 positions): the client's cancel after 2
    # lands from its own thread whenever that runs, and with 40 a fast step outran it
    Ask("cancelled", _tokens(21, 3, 12), 400, cancel=True),
    Ask("branch", LONG[:24] + _tokens(9, 4, 13), 6),  # the trie hits "long"'s prompt
    Ask("one", (14,), 5),  # a one-token prompt
)


def follow_ups(first: dict[str, list[int]]) -> tuple[Ask, ...]:
    """After the wave: "long"'s conversation goes on (its prompt and answer come back
    from the trie) and "short" is asked again."""
    return (
        Ask("continued", LONG + tuple(first["long"]) + _tokens(6, 5, 15), 6),
        Ask("again", SHORT, 4),
    )


def _request(ask: Ask) -> GenerationRequest:
    return GenerationRequest(ask.prompt, ask.max_tokens, SamplingParams(temperature=0.0))


def _collect(handle: RequestHandle, ask: Ask, out: dict[str, Any]) -> None:
    tokens: list[int] = []
    for event in handle:
        if isinstance(event, TextDelta):
            tokens.extend(event.token_ids)
            if ask.cancel and len(tokens) >= CANCEL_AFTER:
                handle.cancel()
        else:
            assert isinstance(event, Finished)
            s = event.stats
            out[ask.name] = {
                "tokens": tokens,
                "reason": event.reason.value,
                "error": event.error,
                "prompt": s.prompt_tokens,
                "completion": s.completion_tokens,
                "cached": s.cached_tokens,
            }
            return


def _together(engine: Engine, asks: tuple[Ask, ...], out: dict[str, Any]) -> None:
    """Submit `asks` back to back, each read (and maybe cancelled) by a thread of its
    own, as clients would; wait for every one."""
    handles = [engine.submit(_request(a)) for a in asks]
    threads = [
        threading.Thread(target=_collect, args=(h, a, out), daemon=True)
        for h, a in zip(handles, asks, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SLOW_S)
    missing = [a.name for a in asks if a.name not in out]
    assert not missing, f"no end for {missing}"


def serve_script(engine: Engine, runner: ModelRunner) -> dict[str, Any]:
    """The requests (the wave, then the follow-ups) through a started engine: each
    one's tokens, ending and token counts, and the runner's batch and trie counters."""
    results: dict[str, Any] = {}
    _together(engine, WAVE, results)
    _together(engine, follow_ups({"long": results["long"]["tokens"]}), results)
    stats = runner.scheduler.stats
    prefix = runner.prefix.stats()
    return {
        "requests": results,
        "max_batch_seen": stats.max_batch_seen,
        "fused_steps": stats.fused_steps,
        "fusable": fusable(runner.loaded.model),
        "prefix": {k: prefix[k] for k in ("requests", "hits", "reused_tokens", "evictions")},
    }


def single_process(loaded: Any) -> dict[str, Any]:
    """`serve_script` on one process's engine (the reference)."""
    runner = ModelRunner(loaded, SETTINGS)
    engine = Engine(runner, max_queue=64)
    engine.start()
    try:
        return serve_script(engine, runner)
    finally:
        engine.stop()


def _lead(loaded: Any, channel: Channel) -> dict[str, Any]:
    """Rank 0, as gateway/cli/serve/distributed.py's `_lead` builds it (without HTTP)."""
    runner = LockstepRunner(loaded, SETTINGS, channel, timeout=TIMEOUT_S, slow_bound=SLOW_S)
    engine = Engine(runner, max_queue=64, stall_seconds=SLOW_S)
    runner.on_lost = engine.halt
    engine.start()
    engine.watch()
    runner.watch()
    try:
        result = serve_script(engine, runner)
    except BaseException as exc:
        runner.shutdown(f"rank 0's script failed: {type(exc).__name__}: {exc}")
        raise
    engine.stop()  # closes the runner: every rank drops its caches
    runner.shutdown()
    return {**result, "lost": runner.lost}


def _run(folder: Path, mode: str, group: Group) -> dict[str, Any]:
    started = time.perf_counter()
    loaded = load_sharded(folder, group, mode, dtype="float32")  # type: ignore[arg-type]
    channel = Channel(group.handle)
    out: dict[str, Any] = {"case": folder.name, "mode": mode}
    if group.rank == 0:
        out.update(_lead(loaded, channel))
    else:
        out["code"] = follow(loaded, channel, timeout=TIMEOUT_S, slow_bound=SLOW_S)
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def main(argv: list[str]) -> int:
    cases, out = Path(argv[1]), Path(argv[2])
    group = Group.init("ring")
    report: dict[str, Any] = {"rank": group.rank, "size": group.size, "results": []}
    path = out / f"rank{group.rank}.json"
    for folder in sorted(p for p in cases.iterdir() if p.is_dir()):
        for mode in json.loads((folder / "reference.json").read_text())["modes"]:
            result = _run(folder, mode, group)
            report["results"].append(result)
            path.write_text(json.dumps(report))
            gc.collect()  # this case's model and caches, before the next one loads
            if result.get("lost") or result.get("code", 0) != 0:
                sys.stdout.flush()
                os._exit(1)  # a collective may be stuck: no interpreter teardown
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
