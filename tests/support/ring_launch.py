"""Ranks of MLX's ring backend on loopback, started the way `mlx.launch -n N --backend
ring` starts them on one host, without that launcher's process in between.

What each rank gets is what mlx.launch gives it: the environment, MLX_RANK, and
MLX_HOSTFILE naming a file that lists one `127.0.0.1:port` per rank (consecutive
ports), so `Group.init("ring")` forms the same group. What is left out is the
launcher's own loop: one reader thread per rank polls that rank's stdin pipe, which is
always writable, so the threads never sleep and kept about 0.8 of a core busy for the
whole run (mlx 0.30's launch.py) - on the suite's 2 shared cores, time the ranks lacked
(4 ranks: 49 s alone). Serving under mlx.launch itself, its teardown included, is
tests/gateway/test_distributed_serve.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_ports(count: int) -> int:
    """A first port from which `count` consecutive ports are free (the ring backend
    listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + count >= 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def _report_end(proc: subprocess.Popen[bytes], rank: int, ended: queue.Queue[int]) -> None:
    proc.wait()
    ended.put(rank)


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill every rank still running (each leads a session of its own)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def run_ring(
    size: int, argv: list[str], *, cwd: Path, env: dict[str, str], logs: Path, timeout: float
) -> tuple[list[int | None], str]:
    """`python argv...` as `size` ranks of one group; waits for all of them, or until
    one fails (then, as mlx.launch does, the others are ended: they would wait on it),
    or for `timeout` seconds (then every rank is killed). Each rank's output goes to
    `logs`/rank<r>.log. Returns the exit codes (None for a rank killed here) and the
    ranks' output, rank by rank."""
    first = free_ports(size)
    hostfile = logs / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(size)]))
    procs: list[subprocess.Popen[bytes]] = []
    ended: queue.Queue[int] = queue.Queue()
    codes: list[int | None] = [None] * size
    try:
        for rank in range(size):
            with open(logs / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *argv],
                        cwd=cwd,
                        env={**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)},
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        for rank, proc in enumerate(procs):
            threading.Thread(target=_report_end, args=(proc, rank, ended), daemon=True).start()
        deadline = time.monotonic() + timeout
        for _ in range(size):
            rank = ended.get(timeout=max(0.0, deadline - time.monotonic()))
            codes[rank] = procs[rank].returncode
            if codes[rank] != 0:
                break
    except queue.Empty:
        pass
    finally:
        _end(procs)
    output = "\n".join(
        f"-- rank {r} (exit {codes[r]}):\n" + (logs / f"rank{r}.log").read_text(errors="replace")
        for r in range(size)
    )
    return codes, output
