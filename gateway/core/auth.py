"""API-key check on every route but /health: `Authorization: Bearer KEY` or `x-api-key: KEY`."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.core.errors import Unauthorized

# Claude Code probes `HEAD /` and `HEAD /api/hello` without its key before it starts;
# they answer 200 and reveal nothing
OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/", "/api/hello"})
# the browser page's static files (gateway/ui/): the page asks for the key itself
OPEN_PREFIX = "/ui/"


def presented_key(headers: Headers) -> str | None:
    """The key a client sent, from either header clients use (OpenAI SDK, Anthropic SDK)."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("x-api-key", "").strip()
    return key or None


def key_matches(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    # constant time: the comparison must not leak how much of a guess was right
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIX):
            await self.app(scope, receive, send)
            return
        presented = presented_key(Headers(scope=scope))
        if key_matches(presented, self.api_key):
            await self.app(scope, receive, send)
            return
        message = (
            "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
            if presented is None
            else "Incorrect API key provided."
        )
        err = Unauthorized(message, code="invalid_api_key")
        headers = {"WWW-Authenticate": 'Bearer realm="mlx-gateway"'}
        response = JSONResponse(
            err.body_for(scope["path"]), status_code=err.status, headers=headers
        )
        await response(scope, receive, send)
