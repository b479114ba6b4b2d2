"""GET / for a browser, and GET /ui/NAME: the page and its files, under a strict
Content-Security-Policy (only this server's own scripts, styles and connections; images
also as data: and blob: URLs, for the ones a user pastes into the chat).

The page and its files hold nothing secret, so they need no key (gateway/core/auth.py
lets /ui/ through); the page asks for the key and sends it with every request it makes.
`HEAD /` and a GET / that does not ask for HTML (API clients, Claude Code's probe) go on
to the routes after these, which answer them as before.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Scope

from gateway.core.errors import NotFound
from gateway.core.http import server_settings

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: blob:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def static_files() -> dict[str, Traversable]:
    """The page's files by name (one flat folder)."""
    folder = resources.files("gateway.ui") / "static"
    return {f.name: f for f in folder.iterdir() if f.is_file()}


def wants_html(headers: Headers) -> bool:
    return "text/html" in headers.get("accept", "").lower()


class PageRoute(Route):
    """Matches a browser's GET only (see the module docstring)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or scope["method"] != "GET":
            return Match.NONE, {}
        if not wants_html(Headers(scope=scope)):
            return Match.NONE, {}
        return super().matches(scope)


# the page learns whether to ask for the key before its first request (a 401 would be
# an error in the browser's console)
KEY_META = b'<meta name="mlx-gateway-key" content="none">'


def _read(name: str) -> bytes:
    found = static_files().get(name)
    if found is None or name[name.rfind(".") :] not in TYPES:
        raise NotFound(f"The page has no file {name!r}.")
    return found.read_bytes()


def _response(name: str, data: bytes) -> Response:
    return Response(data, media_type=TYPES[name[name.rfind(".") :]], headers=HEADERS)


async def page(request: Request) -> Response:
    html = _read("index.html")
    if server_settings(request).api_key is not None:
        html = html.replace(KEY_META, KEY_META.replace(b'"none"', b'"required"'))
    return _response("index.html", html)


async def asset(request: Request) -> Response:
    name = str(request.path_params["name"])
    return _response(name, _read(name))


ROUTES = [
    PageRoute("/", page, methods=["GET"]),
    Route("/ui/{name}", asset, methods=["GET"]),
]
