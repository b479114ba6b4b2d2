"""The server under soak: `mlx-gateway serve` in a subprocess on loopback, with two
models from one file (its own chat template, and a tool-calling template with the
hermes parser, since SmolLM2's own template has no tool format) and the prefix cache's
disk tier in a temporary folder, its log in a file there."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.core.models.build import model_folder

CHAT_MODEL = "soak-chat"
TOOLS_MODEL = "soak-tools"
READY_S = 300.0
# runtime/prefix/disk/files.py's names (not imported: that module loads MLX into this client)
SUFFIX, TMP_SUFFIX = ".safetensors", ".tmp"


@dataclass(frozen=True)
class Options:
    source: str  # alias, path or repo id, as --model takes
    max_queue: int = 4
    max_batch: int = 4
    prefix_cache_bytes: str = "64M"
    prefix_cache_disk_bytes: str = "1G"
    shutdown_grace: float = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    def __init__(self, folder: Path, options: Options) -> None:
        self.folder = folder
        self.options = options
        self.cache_dir = folder / "prefix-cache"
        self.log = folder / "serve.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "models.toml"
        config.write_text(
            f"[[models]]\nsource = {_toml(options.source)}\nid = {_toml(CHAT_MODEL)}\n\n"
            f"[[models]]\nsource = {_toml(options.source)}\nid = {_toml(TOOLS_MODEL)}\n"
            'template_family = "qwen2.5"\nparser = "hermes"\n'
        )
        script = Path(sys.executable).with_name("mlx-gateway")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli.main"]
        command += [
            "--log-level", "info", "serve", "--config", str(config),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prefix-cache-dir", str(self.cache_dir),
            "--prefix-cache-bytes", options.prefix_cache_bytes,
            "--prefix-cache-disk-bytes", options.prefix_cache_disk_bytes,
            "--max-queue", str(options.max_queue), "--max-batch", str(options.max_batch),
            "--shutdown-grace", str(options.shutdown_grace),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_GATEWAY_")}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=30).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready in {READY_S:g} s:\n{self.tail()}")

    def stop(self) -> tuple[int | None, float]:
        """SIGTERM (the drain), then its exit status and how long it took; None when it
        had to be killed."""
        began = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(self.options.shutdown_grace + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            code = None
        return code, time.monotonic() - began

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def cache_files(self, model: str) -> tuple[list[Path], list[Path]]:
        """A model's prefix-cache files on disk: (whole entries, temporary ones)."""
        folder = model_folder(self.cache_dir, model)
        return sorted(folder.glob("*" + SUFFIX)), sorted(folder.glob("*" + TMP_SUFFIX))

    def log_problems(self) -> tuple[int, list[str]]:
        """Tracebacks in the log, and its ERROR lines."""
        text = self.log.read_text(errors="replace")
        errors = [x for x in text.splitlines() if " ERROR " in x or x.startswith("ERROR:")]
        return text.count("Traceback (most recent call last)"), errors


def _toml(text: str) -> str:
    """A TOML basic string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
