"""Starting and stopping the servers bench/agent_replay.py compares (one at a time,
on 127.0.0.1, each in its own process group, always killed in the end)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServerSpec:
    name: str
    note: str
    cmd: tuple[str, ...]
    model: str  # the `model` field requests carry
    ready_path: str
    log_reuse: str | None = None  # regex on the server log: group 1 = reused tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gateway_spec(name: str, alias: str, port: int) -> ServerSpec:
    cmd = [sys.executable, "-m", "gateway.cli.main", "serve", "--model", alias]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    note = "f32 + BLAS, prefix cache on"
    if name == "gateway-nocache":
        cmd += ["--prefix-cache-bytes", "0"]
        note = "f32 + BLAS, --prefix-cache-bytes 0"
    from gateway.cli.common import requested_id  # a path is served by its name

    return ServerSpec(name, note, tuple(cmd), requested_id(alias), "/health")


def _mlx_spec(folder: Path, port: int, n_requests: int, extra: Sequence[str] = ()) -> ServerSpec:
    argv = ["mlx_lm.server", "--model", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    # its LRU keeps whole prompt caches by count: room for every request of the replay
    argv += ["--prompt-cache-size", str(max(10, 2 * n_requests)), "--log-level", "WARNING"]
    argv += list(extra)  # e.g. its batching options (bench/concurrency.py)
    code = (
        "from runtime import backend; backend.configure(); import sys; "
        f"from mlx_lm.server import main; sys.argv = {argv!r}; main()"
    )
    note = f"f32 + BLAS, prompt cache size {max(10, 2 * n_requests)}"
    return ServerSpec("mlx-lm", note, (sys.executable, "-c", code), "default_model", "/health")


def _llama_spec(gguf: Path, port: int, n_ctx: int) -> ServerSpec:
    cores = str(os.cpu_count() or 1)
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", str(n_ctx)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_threads", cores]
    cmd += ["--n_threads_batch", cores, "--cache", "true", "--cache_type", "ram"]
    cmd += ["--cache_size", str(4 << 30), "--verbose", "true"]  # 4 GiB: every state fits
    quant = re.search(r"(?i)(?:^|[.-])((?:I?Q\d\w*)|BF16|F16|F32)$", gguf.stem)
    return ServerSpec(
        "llama.cpp",
        f"GGUF {quant.group(1) if quant else ''} native quantized kernels, RAM prompt cache",
        tuple(cmd),
        gguf.stem,
        "/v1/models",
        log_reuse=r"(\d+) prefix-match hit",
    )


def _one_line(exc: BaseException) -> str:
    """An error fit for a table cell."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split()).replace("|", "/")
    return text if len(text) <= 300 else text[:140] + " ... " + text[-155:]


def _log_tail(path: Path, n: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(encoding="utf-8", errors="replace")[-n:]
    return ""


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}: ...{_log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"not ready after {START_TIMEOUT_S:.0f}s: ...{_log_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # the server runs in its own process group (start_new_session): end it and its children
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


@contextlib.contextmanager
def running(spec: ServerSpec, port: int, log: Path) -> Iterator[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            spec.cmd,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(proc, base + spec.ready_path, log)
            yield base
        finally:
            _stop(proc)
