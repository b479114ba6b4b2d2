"""Finding the gateway a client will talk to: one already serving at --host/--port, or
one launch starts in the background (and stops again when the client exits)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from gateway.cli.common import connectable_host, http_get, requested_id
from gateway.cli.launch.base import LaunchError
from gateway.cli.progress import is_interactive

START_TIMEOUT_S = 900.0  # a first run may download the model before loading it
STOP_GRACE_S = 10.0
_POLL_S = 0.5
_QUIET_REPORT_S = 15.0  # how often to say "still starting" when not on a terminal


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    api_key: str | None

    @property
    def root_url(self) -> str:
        return f"http://{connectable_host(self.host)}:{self.port}"


@dataclass(frozen=True)
class Served:
    """What GET /v1/models says about the served chat model, and the names of the
    embedding models served beside it."""

    model: str
    context_length: int | None
    max_tokens_default: int | None
    aliases: tuple[str, ...]
    source: str | None
    capabilities: dict[str, Any]
    embedders: tuple[str, ...] = ()  # the ids of models whose card says task "embed"
    tasks: Mapping[str, str] = field(default_factory=dict)  # every listed name's task


class Starting(Exception):
    """A gateway answers but its model is still loading (503 on /health)."""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def card_task(card: Mapping[str, Any]) -> str | None:
    """What a /v1/models card serves: "generate", "embed", "rerank"; None where the
    server does not say (its `task`, else its loaded capabilities')."""
    caps = card.get("capabilities")
    task = card.get("task") or (caps.get("task") if isinstance(caps, dict) else None)
    return task if isinstance(task, str) else None


def parse_models(body: bytes) -> Served:
    """The first chat model's card of a /v1/models body (the first card when none says
    it chats), and the embedding models listed; the optional fields (aliases, the
    default output bound, tasks) are read when the server reports them."""
    try:
        data = [c for c in json.loads(body)["data"] if isinstance(c, dict)]
        chat = [c for c in data if card_task(c) not in ("embed", "rerank")]
        card = (chat or data)[0]
        model = str(card.get("alias_of") or card["id"])  # the model's own name first
        tasks = {str(c["id"]): t for c in data if (t := card_task(c)) is not None}
    except (ValueError, KeyError, IndexError, TypeError):
        raise LaunchError(f"GET /v1/models gave no model: {body[:200]!r}") from None
    # an alias's card repeats its model's task: one name for each embedding model
    own = [str(c["id"]) for c in data if card_task(c) == "embed" and not c.get("alias_of")]
    aliases = [a for a in card.get("aliases") or () if isinstance(a, str)]
    # the cards of the model's aliases; a server with several models lists the others too
    aliases += [str(c["id"]) for c in data if isinstance(c, dict) and c.get("alias_of") == model]
    caps = card.get("capabilities")
    return Served(
        model=model,
        context_length=_int(card.get("context_length")),
        max_tokens_default=_int(card.get("max_tokens_default")),
        aliases=tuple(dict.fromkeys(aliases)),  # listed twice by newer servers
        source=card.get("source") if isinstance(card.get("source"), str) else None,
        capabilities=caps if isinstance(caps, dict) else {},
        embedders=tuple(own),
        tasks=tasks,
    )


def probe(endpoint: Endpoint, timeout: float = 3.0) -> Served | None:
    """The served model, or None when nothing listens there. Raises Starting while a
    gateway loads, LaunchError when something else answers or the key is wrong."""
    url = endpoint.root_url
    try:
        status, body = http_get(url + "/health", None, timeout)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None
    if status == 503:
        raise Starting(url)
    if status != 200:
        raise LaunchError(
            f"something that is not mlx-gateway listens at {url} (GET /health answered "
            f"{status}); pick another --port"
        )
    status, body = http_get(url + "/v1/models", endpoint.api_key, timeout)
    if status == 401:
        raise LaunchError(
            f"the gateway at {url} wants an API key: pass --api-key or set MLX_GATEWAY_API_KEY"
            + (" (the one given was refused)" if endpoint.api_key else "")
        )
    if status != 200:
        raise LaunchError(f"GET {url}/v1/models answered {status}: {body[:200]!r}")
    return parse_models(body)


def serves(served: Served, model: str) -> bool:
    """Whether a running gateway serves what `--model MODEL` asks for."""
    if requested_id(model) in (served.model, *served.aliases):
        return True
    path = Path(model).expanduser()
    if served.source and path.exists():
        with contextlib.suppress(OSError):
            return Path(served.source).resolve() == path.resolve()
    return False


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    # Progress bars redraw with "\r": keep only the last state of each line.
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(kept[-lines:])


class ManagedServer:
    """A `mlx-gateway serve` launch started; stop() ends it and anything it spawned."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, log: IO[bytes]) -> None:
        self.proc = proc
        self.log_path = log_path
        self._log = log

    def stop(self, grace: float = STOP_GRACE_S) -> int | None:
        """SIGTERM (uvicorn shuts down cleanly on it), SIGKILL after `grace` seconds."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def _signal(self, sig: signal.Signals) -> None:
        # The server leads its own process group (start_new_session): signal the group
        # so a model fetch it started goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if hasattr(os, "killpg"):
                os.killpg(self.proc.pid, sig)
            else:  # pragma: no cover - Windows
                self.proc.send_signal(sig)


def serve_command(model: str, endpoint: Endpoint, more: Sequence[str] = ()) -> list[str]:
    """`serve` of `model` (the default), then `more` models beside it."""
    models = [arg for name in (model, *more) for arg in ("--model", name)]
    return [
        sys.executable, "-m", "gateway.cli.main", "serve", *models,
        "--host", endpoint.host, "--port", str(endpoint.port),
    ]  # fmt: skip


def start(model: str, endpoint: Endpoint, log_dir: Path, more: Sequence[str] = ()) -> ManagedServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"serve-{endpoint.port}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed by ManagedServer.stop
    env = dict(os.environ)
    env.pop("MLX_GATEWAY_API_KEY", None)
    if endpoint.api_key:
        env["MLX_GATEWAY_API_KEY"] = endpoint.api_key  # not on argv, where ps shows it
    # Its own session: the Ctrl-C a user types into the client must not reach it.
    proc = subprocess.Popen(
        serve_command(model, endpoint, more),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    return ManagedServer(proc, log_path, log)


def wait_ready(
    endpoint: Endpoint,
    out: TextIO,
    server: ManagedServer | None = None,
    *,
    timeout: float = START_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
) -> Served:
    """Poll /health until the model is served, showing the elapsed time and (for a
    server launch started) its latest log line; a failure carries the end of its log."""
    started = clock()
    live = is_interactive(out)
    last_report = started
    while True:
        elapsed = clock() - started
        if server is not None and server.proc.poll() is not None:
            raise LaunchError(
                f"mlx-gateway serve exited (status {server.proc.returncode}) before it was "
                f"ready. The end of {server.log_path}:\n{log_tail(server.log_path)}"
            )
        with contextlib.suppress(Starting):
            served = probe(endpoint, timeout=2.0)
            if served is not None:
                if live:
                    out.write("\r\033[K")
                out.write(f"mlx-gateway: {served.model} is ready ({elapsed:.0f} s)\n")
                return served
        if elapsed > timeout:
            where = f" The end of {server.log_path}:\n{log_tail(server.log_path)}" if server else ""
            raise LaunchError(
                f"the gateway at {endpoint.root_url} was not ready after {timeout:.0f} s.{where}"
            )
        status = log_tail(server.log_path, 1).strip()[:70] if server else "loading the model"
        if live:
            out.write(f"\r\033[K  waiting for the gateway: {elapsed:4.0f} s  {status}")
            out.flush()
        elif clock() - last_report >= _QUIET_REPORT_S:
            last_report = clock()
            out.write(f"  still waiting for the gateway ({elapsed:.0f} s): {status}\n")
            out.flush()
        time.sleep(_POLL_S)
