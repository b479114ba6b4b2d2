"""GET /metrics and the middleware that counts every HTTP request.

The series themselves, and what the engines report through them, live in
`gateway.core.metrics`; this module only serves them and feeds the request counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.metrics import EngineView, Metrics

if TYPE_CHECKING:
    from gateway.core.models import ModelRegistry

# the 0.0.4 text format is what generate_latest writes
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# the label values a client cannot choose: any other method is "other", and a request
# that matched no route ("unmatched": a random URL, or refused before routing, without
# its key for one) shares one route label, so no request adds series without bound
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _method(scope: Scope) -> str:
    method = scope["method"]
    return method if method in METHODS else "other"


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.metrics
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        metrics.in_flight.inc()
        try:
            await self.app(scope, receive, watch)
        finally:
            metrics.in_flight.dec()
            metrics.request_done(_method(scope), _route(scope), status)


async def metrics_endpoint(request: Request) -> Response:
    """Every configured model's engine series; an unloaded model's counters keep what its
    earlier engines counted, its gauges read 0."""
    metrics: Metrics = request.app.state.metrics
    models: ModelRegistry = request.app.state.models
    views = [EngineView(s.spec.id, s.queue_depth, s.stats) for s in models.status()]
    return Response(metrics.render(views), media_type=CONTENT_TYPE)


ROUTES = [
    Route("/metrics", metrics_endpoint, methods=["GET"]),
]
