"""Distributed serving: communication per token and time per step over 1, 2 and 4 ranks,
tensor and pipeline parallel, against one process, measured in the same run.

For each model, each configuration runs in processes of its own:
  1 process      the plain engine (runtime.engine.runner.ModelRunner), no group
  1 rank         the lockstep engine over a group of one (its control rounds alone)
  N ranks MODE   `mlx.launch -n N` on this host: every rank loads its part
                 (runtime.distributed.load_sharded), rank 0 leads the engine
                 (runtime.distributed.lockstep), the others follow
Each prefills a prompt and decodes `--gen-tokens` greedily, alone, then `--batch`
requests at once. Printed per configuration: the model's bytes sent per token by rank 0
(`comm_bytes_per_token`: the all_sums of tensor parallel, the hand-off and broadcast of
pipeline parallel), the lockstep's own bytes per decode step (one control round and the
sampled tokens), prefill tokens/s, decode ms per step alone and per batched step, and
each against one process.

On one machine the ranks share its cores (here 2), so speed-up is not the measure: the
ratios show what the group's communication and lockstep cost. On a GPU host, pass
`--backend nccl` (one GPU per rank). A model that cannot be split so (a head count the
rank count does not divide) gets a row saying why.

    python bench/distributed.py [--models smollm2-135m qwen2.5-coder-0.5b]
        [--ranks 2 4] [--modes tensor pipeline] [--prompt-tokens 256]
        [--gen-tokens 32] [--batch 4] [--backend ring]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MARK = "BENCH-RESULT "
LAUNCH = Path(sys.executable).parent / "mlx.launch"
TIMEOUT_S = 1800


def _prompt_ids(vocab: int, n: int, salt: int) -> list[int]:
    # deterministic, spread over the vocabulary, a distinct first token per request so
    # the prefix cache cannot help
    return [salt + 256, *((1009 * i + 7) % (vocab - 512) + 256 for i in range(n - 1))]


# ---------------------------------------------------------------- worker (every rank)
def _timed(engine: Any, requests: list[Any]) -> list[list[float]]:
    """Submit `requests` at once; each one's event arrival times."""
    handles = [engine.submit(r) for r in requests]
    times: list[list[float]] = []
    for handle in handles:
        arrivals = []
        for event in handle:
            arrivals.append(time.perf_counter())
            if hasattr(event, "reason"):
                assert event.reason.value in ("stop", "length"), event
        times.append(arrivals)
    return times


def _measure(engine: Any, vocab: int, args: argparse.Namespace) -> dict[str, float]:
    from runtime.types import GenerationRequest, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    gen, prompt = args.gen_tokens, args.prompt_tokens

    def request(salt: int, n: int = prompt) -> GenerationRequest:
        return GenerationRequest(tuple(_prompt_ids(vocab, n, salt)), gen, greedy)

    _timed(engine, [request(0, 32)])  # warm up
    start = time.perf_counter()
    (alone,) = _timed(engine, [request(1)])
    first, last = alone[0], alone[-2]  # the token events, then the Finished
    batch = _timed(engine, [request(2 + i, 64) for i in range(args.batch)])
    steps = min(len(t) for t in batch) - 2
    spans = [t[steps] - t[0] for t in batch]
    return {
        "prefill_tps": prompt / (first - start),
        "decode_ms": 1000 * (last - first) / max(1, len(alone) - 2),
        "batch_ms": 1000 * max(spans) / max(1, steps),
    }


def _lockstep_bytes(size: int, batch: int) -> int:
    """What rank 0 sends per decode step for the lockstep itself: one control round (the
    header, 16 + 4 words per rank) and the sampled tokens, each a ring all_sum."""
    if size == 1:
        return 0

    def ring(nbytes: int) -> int:
        return 2 * (size - 1) * math.ceil(nbytes / size)

    return ring(4 * (16 + 4 * size)) + ring(4 * batch)


def worker(args: argparse.Namespace) -> None:
    from runtime import backend

    backend.configure()
    import dataclasses

    from runtime.distributed import (
        Channel,
        Group,
        LockstepRunner,
        comm_bytes_per_token,
        follow,
        load_sharded,
    )
    from runtime.engine import Engine, ModelRunner, RunnerSettings
    from runtime.load import load

    settings = RunnerSettings(prefix_cache_bytes=0, max_batch=max(1, args.batch))
    if args.config == "process":
        loaded = load(args.model)
        runner: ModelRunner = ModelRunner(_no_eos(loaded, dataclasses), settings)
        size, rank, comm = 1, 0, 0
    else:
        group = Group.init(args.backend, strict=args.config != "rank")
        size, rank = group.size, group.rank
        try:
            loaded = load_sharded(args.model, group, args.mode)
        except ValueError as exc:  # cannot be split so: the row says why
            if rank == 0:
                print(MARK + json.dumps({"error": str(exc)}), flush=True)
            os._exit(0)
        loaded = _no_eos(loaded, dataclasses)
        comm = comm_bytes_per_token(loaded.model, group, args.mode) if size > 1 else 0
        channel = Channel(group.handle)
        if rank != 0:
            os._exit(follow(loaded, channel))
        runner = LockstepRunner(loaded, settings, channel)
    engine = Engine(runner)
    engine.start()
    result = _measure(engine, loaded.model.args.vocab_size, args)
    engine.stop()
    if isinstance(runner, LockstepRunner):
        runner.shutdown()
    result |= {"comm_bytes": comm, "lockstep_bytes": _lockstep_bytes(size, args.batch)}
    print(MARK + json.dumps(result), flush=True)
    os._exit(0)  # a group's teardown is the launcher's; MLX arrays need no goodbye here


def _no_eos(loaded: Any, dataclasses: Any) -> Any:
    return dataclasses.replace(loaded, eos_token_ids=frozenset())  # always gen_tokens


# ---------------------------------------------------------------- driver
def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = int(s.getsockname()[1])
        if first + 8 < 65536 and all(_free(first + i) for i in range(1, 8)):
            return first
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _run(
    config: str, model: Path, ranks: int, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    own = [
        str(Path(__file__).resolve()), "--worker", "--config", config, "--model", str(model),
        "--mode", mode, "--prompt-tokens", str(args.prompt_tokens),
        "--gen-tokens", str(args.gen_tokens), "--batch", str(args.batch),
        "--backend", args.backend if ranks > 1 else "any",
    ]  # fmt: skip
    if ranks > 1:
        cmd = [str(LAUNCH), "-n", str(ranks), "--backend", args.backend]
        if args.backend == "ring":
            cmd += ["--starting-port", str(_free_port_pair())]
        cmd += ["--python", sys.executable, "--", *own]
    else:
        cmd = [sys.executable, *own]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    for line in (done.stdout + done.stderr).splitlines():
        if MARK in line:
            return dict(json.loads(line.split(MARK, 1)[1]))
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
    return {"error": f"no result (exit {done.returncode}): {tail}"}


def _row(name: str, r: dict[str, Any], base: dict[str, Any] | None) -> str:
    if "error" in r:
        return f"  {name:<16} {r['error'][:120]}"

    def ratio(key: str) -> str:
        if base is None or "error" in base or not base.get(key):
            return "   -  "
        return f"{r[key] / base[key]:5.2f}x"

    return (
        f"  {name:<16} {r['comm_bytes'] / 1024:9.1f} {r['lockstep_bytes']:9d} "
        f"{r['prefill_tps']:9.1f} {ratio('prefill_tps')} {r['decode_ms']:9.1f} "
        f"{ratio('decode_ms')} {r['batch_ms']:9.1f} {ratio('batch_ms')}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["tensor", "pipeline"])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--backend", default="ring")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="process", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="tensor", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from gateway.cli.store.store import Store

    print(f"{os.cpu_count()} cores; prompt {args.prompt_tokens} tokens, {args.gen_tokens} "
          f"generated, batch {args.batch}; backend {args.backend}")  # fmt: skip
    print(
        f"  {'':<16} {'KiB/token':>9} {'ctl B/st':>9} {'prefill/s':>9} {'':6} "
        f"{'ms/step':>9} {'':6} {'batch ms':>9}"
    )
    for alias in args.models:
        model = Store().resolve(alias)
        print(alias)
        base = _run("process", model, 1, "tensor", args)
        print(_row("1 process", base, None), flush=True)
        print(_row("1 rank lockstep", _run("rank", model, 1, "tensor", args), base), flush=True)
        for ranks in args.ranks:
            for mode in args.modes:
                got = _run("group", model, ranks, mode, args)
                print(_row(f"{ranks} ranks {mode}", got, base), flush=True)


if __name__ == "__main__":
    main()
