"""How rank 0 of a distributed group takes its signals: a stop, or the launcher's
teardown of a group that broke.

mlx.launch ends every rank with one SIGTERM once any rank exits with an error (a rank
started over ssh gets its session's SIGHUP first, then that SIGTERM). Rank 0 would then
drain and leave, and clients would lose the server that tells them why. So:

- SIGTERM or SIGHUP: rank 0 first looks at the group, for at least `DECIDE_S` seconds
  while it goes on serving, and while a round is in flight until its watchdog has had
  its say (a rank that died silently is known only when the round's bound runs out,
  `--distributed-timeout` plus the step's). The group broke when the runner reports it
  lost (a peer's socket closed, or the watchdog gave up on a silent rank); it is healthy
  once two rounds complete after the signal (a rank that was already gone can finish at
  most the one in flight). Healthy, or not known within the wait: drain and exit as
  always.
  Broke: rank 0 stays up ("lingers"), answering 503s that say why, with /health and
  /v1/models answering; it says on its output, once, which file its log goes to, and
  moves its stdout and stderr there (os.dup2), so that no write can block on a launcher
  that no longer reads its pipe (mlx.launch waits for the rank it signalled, unread).
- SIGINT (Ctrl-C: a person) drains and exits as always, group broken or not.
- Lingering, a SIGINT or a second SIGTERM ends the process with status 1 (`FAILED`, as
  when a rank 0 that lost its group leaves); a SIGHUP, or the launcher's first SIGTERM
  after a hangup, does not.
- Any other second signal, while deciding or draining, exits at once (as always).

Every rank leaves through `leave`: the process ends without the interpreter's teardown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import uvicorn
from starlette.applications import Starlette

from gateway.cli.errors import FAILED
from gateway.cli.store.store import gateway_home
from gateway.server import DrainingServer

if TYPE_CHECKING:
    from runtime.distributed import LockstepRunner

log = logging.getLogger(__name__)

DECIDE_S = 3.0  # after a SIGTERM, how long rank 0 waits at least to hear whether the group broke
WATCH_SLACK_S = 0.5  # past a round's watchdog deadline: the watchdog looks every 0.1 s
_POLL_S = 0.05


def log_path(port: int) -> Path:
    """Where a lingering rank 0 logs (beside `mlx-gateway launch`'s serve-<port>.log)."""
    return gateway_home() / "logs" / f"distributed-rank0-{port}.log"


class GroupServer(DrainingServer):
    """Rank 0's server: a DrainingServer that lingers when the group broke (above)."""

    def __init__(
        self, config: uvicorn.Config, app: Starlette, grace: float, runner: LockstepRunner
    ) -> None:
        super().__init__(config, app, grace)
        self.runner = runner
        self.phase = "serving"  # then deciding, draining or lingering
        self._terms = 0  # SIGTERMs heard

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        signal.signal(signal.SIGHUP, self.handle_exit)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Every signal's handler (main thread, between bytecodes)."""
        if sig == signal.SIGTERM:
            self._terms += 1
        stop = sig == signal.SIGINT or self._terms >= 2  # what a person sends to stop it
        if self.phase == "lingering":
            if stop:
                self._leave(sig)
            log.warning("%s: staying up (a SIGINT or a second SIGTERM stops)", _name(sig))
            return
        if self.phase == "deciding" and not stop:
            return  # the launcher's SIGTERM after a hangup, or a hangup after its SIGTERM
        loop = self._loop
        if self.phase == "serving" and sig != signal.SIGINT and loop and self.started:
            self.phase = "deciding"
            self._signalled = True  # a stop meanwhile exits at once
            loop.call_soon_threadsafe(self._start_decision, sig)
            return
        self.phase = "draining"
        super().handle_exit(sig, frame)  # a drain, or (a second signal) the exit

    def _start_decision(self, sig: int) -> None:
        self._draining = asyncio.ensure_future(self._decide(sig))

    async def _decide(self, sig: int) -> None:
        why = await self._lost_within(DECIDE_S)
        if self.phase != "deciding":
            return
        if why is None:
            self.phase = "draining"
            await self._drain(sig)
        else:
            self.phase = "lingering"
            self._linger(sig, why)

    async def _lost_within(self, seconds: float) -> str | None:
        """Why the group was lost, if the runner says so within `seconds`, or before the
        watchdog's deadline for the round in flight (and its slack) passes; None once two
        rounds complete (every rank answered after the signal) or time is up. At most
        `seconds` plus the group's `--distributed-timeout`: a prefill's round may be
        bounded by minutes, and a person's SIGTERM must not wait that long."""
        runner = self.runner
        start, now = runner.channel.rounds, time.monotonic()
        deadline, cap = now + seconds, now + seconds + runner.timeout + WATCH_SLACK_S
        while runner.lost is None and runner.channel.rounds < start + 2:
            watched = runner.watched_until
            if watched is not None:
                deadline = min(cap, max(deadline, watched + WATCH_SLACK_S))
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        return runner.lost

    def _linger(self, sig: int, why: str) -> None:
        path = redirect_output(log_path(self.config.port), why)
        log.error(
            "%s after the distributed group was lost (%s): rank 0 stays up, answering "
            "503s and /health, until a SIGINT or a second SIGTERM; restart the group with "
            "mlx.launch (this log: %s)",
            _name(sig),
            why,
            path,
        )

    def _leave(self, sig: int) -> None:
        log.error("%s: leaving (the distributed group was lost: %s)", _name(sig), self.runner.lost)
        leave(FAILED)


def redirect_output(path: Path, why: str) -> Path:
    """Say on stderr, once, that the log goes to `path` from now on; then point fds 1 and
    2 there (appending). The file that took them (os.devnull when `path` cannot be opened)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        log.error("cannot open %s (%s): the log goes nowhere", path, exc)
        path, fd = Path(os.devnull), os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stdout.flush()
        sys.stderr.write(
            f"mlx-gateway: the distributed group was lost ({why}); rank 0 stays up answering "
            f"503s until a SIGINT or a second SIGTERM; its log is now {path}\n"
        )
        sys.stderr.flush()
    except OSError:  # a hung-up terminal (the ssh session is gone)
        pass
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def _name(sig: int) -> str:
    return signal.Signals(sig).name


def leave(code: int) -> NoReturn:
    """End the process without the interpreter's teardown: a peer that was lost can
    leave an MLX call blocked in another thread, which the teardown would wait on (or
    abort over)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
