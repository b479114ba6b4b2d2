"""A bound on open connections, answered in the client's dialect.

uvicorn's own `limit_concurrency` answers beyond it with a plain-text 503 and no
Retry-After; here the protocol counts the same connections (the server's shared set)
and a request that arrives on one connection too many gets the dialect's 503 with
Retry-After, and its connection closes. Idle kept-alive connections count: each holds
a socket, and a body of up to --max-body-bytes once it sends one.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.core.errors import Overloaded
from gateway.core.settings import ServerSettings
from gateway.server.head_deadline import HeadDeadlineProtocol, head_deadline_protocol


class ConnectionLimit:
    """The app, behind a check of how many connections are open when a request arrives."""

    def __init__(self, app: ASGIApp, connections: set[Any], limit: int, retry_after: int) -> None:
        self.app = app
        self.connections = connections
        self.limit = limit
        self.retry_after = retry_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or len(self.connections) <= self.limit:
            await self.app(scope, receive, send)
            return
        err = Overloaded(
            f"This server has {len(self.connections)} connections open, more than the "
            f"{self.limit} it serves at once (--max-connections); retry shortly, or close "
            "idle connections.",
            code="too_many_connections",
            headers={"Retry-After": str(self.retry_after), "Connection": "close"},
        )
        path = scope["path"]
        response = JSONResponse(err.body_for(path), status_code=err.status, headers=err.headers)
        await response(scope, receive, send)


class BoundedProtocol(HeadDeadlineProtocol):
    """The head deadline's protocol, whose app is behind the connection bound."""

    max_connections: int | None = None  # set by `server_protocol`
    retry_after = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.max_connections is not None:
            self.app = ConnectionLimit(
                self.app, self.connections, self.max_connections, self.retry_after
            )


def server_protocol(settings: ServerSettings) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn's `http=`: request heads under the settings'
    deadline, connections under their bound."""
    head = head_deadline_protocol(settings.head_timeout_seconds)
    fields = {
        "max_connections": settings.max_connections,
        "retry_after": settings.retry_after_seconds,
    }
    return type("Bounded", (BoundedProtocol, head), fields)
