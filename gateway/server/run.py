"""Runs the app under uvicorn with a drain in front of uvicorn's signal handling.

uvicorn's first SIGTERM or SIGINT closes the listening socket and then waits for every
open connection to close, so a long generation kept the process up for as long as it
ran ("Waiting for connections to close"), and a client arriving meanwhile was refused a
connection rather than told to retry. Here the first signal drains instead: the engine
refuses new generations (a 503 with Retry-After in each dialect's error shape; /health
says `draining`), the running ones get `grace` seconds to finish, the rest are then
cancelled (each stream ends with its dialect's error event, not a dropped connection),
and only then does uvicorn shut down; the process exits 0. A second signal exits at
once.

When the default model cannot load (a truncated or damaged file), uvicorn would log
Starlette's traceback of the lifespan and exit 3; the cause is the user's to fix, so it
becomes the CLI's one-line error instead (exit 1), the traceback at --log-level debug.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.errors import APIError
from gateway.core.models import ModelRegistry
from gateway.core.settings import ServerSettings
from gateway.server.connections import server_protocol

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
# after the engine's work ended, how long the answers get to go out before uvicorn
# shuts down (and, as its graceful-shutdown timeout, to close their connections)
FLUSH_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Starlette, grace: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace = max(0.0, grace)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler uvicorn installs (in the main thread, between bytecodes).
        Not uvicorn's own: that one re-raises the signal after shutdown, which would end
        the process by the signal instead of with status 0."""
        if self._signalled:
            name = signal.Signals(sig).name
            sys.stderr.write(f"mlx-gateway: second {name}: exiting now\n")
            sys.stderr.flush()
            os._exit(128 + sig)
        self._signalled = True
        loop = self._loop
        if loop is None or not self.started:
            self.should_exit = True  # still loading the model: stop once that ends
            return
        loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        self._draining = asyncio.ensure_future(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        try:
            models = getattr(self.app.state, "models", None)
            if isinstance(models, ModelRegistry):
                await self._finish_work(models, signal.Signals(sig).name)
                await self._flush()
        finally:
            self.should_exit = True

    async def _finish_work(self, models: ModelRegistry, name: str) -> None:
        """Every loaded model's engine refuses new work; what runs gets the grace."""
        models.drain()
        loop = asyncio.get_running_loop()
        if models.pending:
            log.warning(
                "%s: draining: new requests get 503; %d running get up to %g s to finish "
                "(a second signal exits at once)",
                name,
                models.pending,
                self.grace,
            )
        deadline = loop.time() + self.grace
        while models.pending and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if models.pending:
            cancelled = models.cancel_all("server shutting down")
            log.warning("cancelled %d requests still running after %g s", cancelled, self.grace)

    async def _flush(self) -> None:
        """Let the answers that just got their final events send them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FLUSH_S
        while self.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(0.05)


class StartupGuard:
    """The app as uvicorn sees it: keeps a failed startup's exception, and hands uvicorn
    the failure without Starlette's traceback text (which uvicorn would log)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.failure: BaseException | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        failed = False

        async def quiet(message: Message) -> None:
            nonlocal failed
            if message["type"] == "lifespan.startup.failed":
                failed = True
                message = {"type": message["type"], "message": ""}
            await send(message)

        try:
            await self.app(scope, receive, quiet)
        except BaseException as exc:
            if failed:
                self.failure = exc
                log.debug("startup failed", exc_info=exc)
            raise


def startup_error(exc: BaseException) -> str:
    """One line for the CLI: an API error's own message (it says which model and why)."""
    text = exc.message if isinstance(exc, APIError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


MakeServer = Callable[[uvicorn.Config, Starlette, float], DrainingServer]


class StartupFailed(Exception):
    """The server never accepted a connection: its default model did not load. The
    message says why, in one line."""


def run_server(
    app: Starlette,
    *,
    host: str,
    port: int,
    log_level: str,
    grace: float = DEFAULT_GRACE_S,
    server: MakeServer = DrainingServer,
) -> int:
    """Serve until a signal, drained as above (by `server`'s rules: a DrainingServer,
    or one that takes its signals otherwise); the process's exit status. A startup that
    fails (the default model does not load) raises StartupFailed."""
    guard = StartupGuard(app)
    settings: ServerSettings = app.state.settings
    config = uvicorn.Config(
        guard,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(FLUSH_S),
        http=server_protocol(settings),
    )
    try:
        server(config, app, grace).run()
    except SystemExit:  # uvicorn's exit after a failed startup
        if guard.failure is None:
            raise
        raise StartupFailed(startup_error(guard.failure)) from None
    return 0
