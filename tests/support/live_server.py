"""Run the gateway on 127.0.0.1 in a background thread for end-to-end tests."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.core.models.registry import ModelRegistry
from gateway.core.models.served import ServedModel
from gateway.core.settings import ServerSettings
from gateway.server import server_protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def live_server(
    load: ModelRegistry | Callable[[], ServedModel],
    settings: ServerSettings | None = None,
    **uvicorn_options: Any,
) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT) of a running server: of one model
    (`load` builds it), or of a registry's models. `uvicorn_options` go to uvicorn's
    Config (e.g. log_level="info", log_config=None to see its logs in caplog)."""
    port = free_port()
    app = create_app(load, settings)
    protocol = server_protocol(settings or ServerSettings())  # head deadline, connection bound
    options = {"log_level": "warning", "http": protocol, **uvicorn_options}
    config = uvicorn.Config(app, host="127.0.0.1", port=port, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
