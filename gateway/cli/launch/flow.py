"""The steps of one launch: find or start the gateway, check the context fits the client,
write the client's files, run the client, stop what launch started."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

from gateway.cli.common import requested_id
from gateway.cli.launch import server as srv
from gateway.cli.launch.base import ROOM, Asker, Client, LaunchError, Target
from gateway.cli.launch.files import write_atomic
from gateway.cli.store.store import gateway_home

# Known aliases with a long context, for the warning to name (largest last).
LONG_CONTEXT_ALIASES = (("qwen2.5-coder-0.5b", 32_768),)
_PLACEHOLDER_KEY = "YOUR-API-KEY"


def log_dir() -> Path:
    return gateway_home() / "logs"


@contextlib.contextmanager
def gateway(
    endpoint: srv.Endpoint,
    model: str | None,
    default_model: str,
    out: TextIO,
    embedding_model: str | None = None,
) -> Iterator[tuple[srv.Served, bool]]:
    """The served model, and whether launch started its server (then stopped on exit);
    a server launch starts serves `embedding_model` too, one running must list it."""
    url = endpoint.root_url
    try:
        served = srv.probe(endpoint)
    except srv.Starting:
        out.write(f"a gateway at {url} is loading its model; waiting for it\n")
        served = srv.wait_ready(endpoint, out)
    if served is not None:
        if model is not None and not srv.serves(served, model):
            raise LaunchError(
                f"the gateway at {url} serves {served.model!r}, not {model!r}. Stop it, "
                f"start another one with --port, or leave out --model to use {served.model!r}"
            )
        check_embedder(served, embedding_model, url)
        out.write(f"using the gateway at {url} (model {served.model})\n")
        yield served, False
        return
    name = model or default_model
    more = (embedding_model,) if embedding_model else ()
    handle = srv.start(name, endpoint, log_dir(), more)
    shown = " ".join(f"--model {m}" for m in (name, *more))
    out.write(
        f"no gateway at {url}: started `mlx-gateway serve {shown}` (log: {handle.log_path})\n"
    )
    try:
        served = srv.wait_ready(endpoint, out, handle)
        check_embedder(served, embedding_model, url)
        yield served, True
    finally:
        handle.stop()
        out.write(f"stopped the gateway launch started (pid {handle.proc.pid})\n")


def check_embedder(served: srv.Served, name: str | None, url: str) -> None:
    """`--embedding-model NAME` must be an embedding model the gateway lists."""
    if name is None:
        return
    wanted = requested_id(name)
    if wanted not in served.tasks and wanted not in (served.model, *served.aliases):
        raise LaunchError(
            f"the gateway at {url} does not serve {name!r}: restart it with "
            f"`--model {served.model} --model {name}` (or leave out --embedding-model)"
        )
    task = served.tasks.get(wanted)
    if task not in (None, "embed"):
        raise LaunchError(
            f"{name!r} is not an embedding model (the gateway serves it for {task!r})"
        )


def embedder(served: srv.Served, name: str | None) -> str | None:
    """The embedding model clients are pointed at: --embedding-model's, else the first
    the gateway lists, else None."""
    if name is not None:
        return requested_id(name)
    return served.embedders[0] if served.embedders else None


def reply_budget(served: srv.Served) -> int:
    """The output bound to give clients: the server's default for requests that set none
    (else 8192), within a quarter of the context so the prompt keeps most of it."""
    ctx = served.context_length
    budget = served.max_tokens_default or 8192
    return max(256, min(budget, ctx // 4)) if ctx else budget


def make_target(
    endpoint: srv.Endpoint, served: srv.Served, embedding_model: str | None = None
) -> Target:
    caps = served.capabilities
    return Target(
        root_url=endpoint.root_url,
        model=served.model,
        context_length=served.context_length,
        max_output=reply_budget(served),
        api_key=endpoint.api_key,
        vision=bool(caps.get("vision")),
        thinking=bool(caps.get("thinking")),
        embedding_model=embedder(served, embedding_model),
    )


def context_warning(client: Client, served: srv.Served, started: bool) -> str | None:
    """Why the served context is too small for this client, and what fits; None if it fits."""
    ctx = served.context_length
    need = client.prompt_tokens + ROOM
    if ctx is None or ctx >= need:
        return None
    fits = [(alias, n) for alias, n in LONG_CONTEXT_ALIASES if n >= need]
    if fits and started:
        fix = f"Run launch with --model {fits[0][0]} ({fits[0][1] // 1024}k context) instead."
    elif fits:
        fix = (
            f"Restart the gateway with `mlx-gateway serve --model {fits[0][0]}` "
            f"({fits[0][1] // 1024}k context), or let launch start one on another --port "
            f"with --model {fits[0][0]}."
        )
    else:
        fix = f"Serve a model with at least {need} tokens of context (--model PATH)."
    return (
        f"{served.model} has a {ctx}-token context, but {client.title}'s first request "
        f"alone is about {client.prompt_tokens} tokens (its instructions and tools) and a "
        f"session needs about {need}: its requests will fail with context_length_exceeded. " + fix
    )


def check_context(
    client: Client, served: srv.Served, started: bool, asker: Asker, out: TextIO, action: str
) -> None:
    """Warn, and ask whether to go on with `action`, when the context is too small."""
    warning = context_warning(client, served, started)
    if warning is None:
        return
    out.write(f"WARNING: {warning}\n")
    if not asker.confirm(f"{action} anyway?"):
        raise LaunchError("cancelled")


def write_files(client: Client, target: Target, asker: Asker, out: TextIO) -> None:
    """All questions first, then all writes: a "no" leaves every file as it was."""
    for note in client.notes(target):
        out.write(note + "\n")
    planned = client.files(target)
    changes = [p for p in planned if not (p.path.exists() and p.path.read_bytes() == p.data)]
    for p in changes:
        if p.confirm and not asker.confirm(p.confirm):
            raise LaunchError("cancelled: no file was changed")
    for p in planned:
        if p not in changes:
            out.write(f"{p.path} is up to date\n")
            continue
        written = write_atomic(p.path, p.data, client.name, mode=p.mode)
        saved = f" (the previous version is in {written.backup})" if written.backup else ""
        out.write(f"wrote {p.path}{saved}\n")


def manual(client: Client, exe: Path | None, target: Target) -> str:
    """The command that starts the client by hand against what --config set up."""
    shown = target
    if target.api_key:
        shown = dataclasses.replace(target, api_key=_PLACEHOLDER_KEY)
    line = client.manual(exe or Path(client.binary), shown)
    return line + (
        f"\n(with the gateway's key in place of {_PLACEHOLDER_KEY})" if shown.api_key else ""
    )


@contextlib.contextmanager
def _relay_signals(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """While the client runs: Ctrl-C is the client's (the terminal sends it to the
    client too), and a SIGTERM or SIGHUP to launch is passed on, so launch outlives the
    client and can stop the gateway after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def relay(signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGINT:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    names = ("SIGINT", "SIGTERM", "SIGHUP")
    sigs = [getattr(signal, n) for n in names if hasattr(signal, n)]
    previous = {s: signal.signal(s, relay) for s in sigs}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_client(client: Client, exe: Path, target: Target, args: Sequence[str], out: TextIO) -> int:
    inv = client.invocation(exe, target, args, os.environ)
    out.write(f"starting {client.title}: {shlex.join(inv.argv)}\n")
    out.flush()
    try:
        proc = subprocess.Popen(inv.argv, env=inv.env)
    except OSError as exc:
        raise LaunchError(f"could not start {exe}: {exc}") from None
    with _relay_signals(proc):
        code = proc.wait()
    return 128 - code if code < 0 else code  # killed by a signal: the shell's convention
