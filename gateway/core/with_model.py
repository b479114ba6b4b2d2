"""The one way a route gets the model a request names: look it up (404 in the route's
dialect for an unknown name), hold a lease on it for the whole response, and wait for it
to load when it is not loaded.

A non-streaming request simply waits. A streaming one starts its event stream at once
and sends the dialect's keepalives while the model loads, so clients with a read
timeout keep the connection; an error found after that (the load failed, the prompt
does not fit) arrives as the dialect's SSE error event instead of a status code.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.core.errors import Overloaded
from gateway.core.generation import ErrorEvents, errors_as_events, openai_error_events
from gateway.core.http import server_settings
from gateway.core.keepalive import NO_TIMER_PING, with_keepalives
from gateway.core.models import Lease, ModelRegistry, ModelSpec, ServedModel

log = logging.getLogger(__name__)

Run = Callable[[ServedModel], Awaitable[Response]]


def registry_of(request: Request) -> ModelRegistry:
    """The app's registry; a 503 while the server is still starting."""
    models = getattr(request.app.state, "models", None)
    if not isinstance(models, ModelRegistry):
        raise Overloaded(
            "The server is still starting; retry shortly.", headers={"Retry-After": "5"}
        )
    return models


class _Leased(Response):
    """A response that holds its model's lease until its last byte is sent (or the
    client leaves), so a keep-alive or LRU unload never pulls the model from under it."""

    def __init__(self, inner: Response, lease: Lease) -> None:
        super().__init__(status_code=inner.status_code)
        self.inner = inner
        self.lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.lease.release()


async def with_model(
    request: Request,
    name: str | None,
    run: Run,
    *,
    stream: bool = False,
    on_error: ErrorEvents = openai_error_events,
    ping: Callable[[], ServerSentEvent] | None = None,
) -> Response:
    """`run(served)` on the model `name` names (None: the default model). `on_error`
    and `ping` are the dialect's error events and keepalive, for a stream that starts
    before the model has loaded."""
    models = registry_of(request)
    spec = models.find(name)
    lease = models.lease(spec)
    try:
        served = models.loaded(spec)
        if served is None and stream:
            response: Response = _deferred(request, models, spec, run, on_error, ping)
        else:
            response = await run(served or await models.ready(spec))
    except BaseException:
        lease.release()
        raise
    return _Leased(response, lease)


def _deferred(
    request: Request,
    models: ModelRegistry,
    spec: ModelSpec,
    run: Run,
    on_error: ErrorEvents,
    ping: Callable[[], ServerSentEvent] | None,
) -> EventSourceResponse:
    """A stream whose first bytes go out before the model has loaded: keepalives while
    it loads, then the route's own stream."""

    async def body() -> AsyncIterator[Any]:
        served = await models.ready(spec)
        response = await run(served)
        inner = getattr(response, "body_iterator", None)
        if inner is None:  # not a stream after all (nothing to generate): its JSON body
            yield {"data": bytes(response.body).decode("utf-8")}
            return
        try:
            async for item in inner:
                yield item
        finally:
            if isinstance(inner, AsyncGenerator):
                await inner.aclose()  # its own guard cancels the generations

    settings = server_settings(request)
    return EventSourceResponse(
        with_keepalives(
            errors_as_events(body(), on_error, began=False), settings.keepalive_seconds, ping
        ),
        ping=NO_TIMER_PING,  # keepalives only while idle, never after the last event
        send_timeout=30,
    )
