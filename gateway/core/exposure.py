"""Who may reach the server, checked before a request is read: the Host it was sent to,
the type of its body, and where it comes from for the local-only pages.

A server on a loopback address is still reachable from every web page its user opens:
a page may POST to it cross-site without asking (a "simple" request: a form, text/plain,
or a body with no type), and a name the page's owner controls may be re-pointed at
127.0.0.1 (DNS rebinding), after which the page reads the answers as its own. So:

- Host: a loopback bind answers only localhost, 127.0.0.1, [::1], its own host and the
  names given with --allowed-hosts (a proxy's or a tunnel's). A bind on another address
  answers any IP address (a rebinding page always sends a name) and those names when it
  has no API key, and any Host when it has one (the key protects it) unless
  --allowed-hosts is given. "*" turns the check off.
- Content-Type: a POST whose type a browser may send cross-site is a 415 (every POST
  here takes JSON); so is one with no type that came from a browser (an Origin header).
- /metrics and /debug/*: without an API key, only for clients on this machine.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.core.errors import APIError, Forbidden, UnsupportedMediaType
from gateway.core.settings import ServerSettings

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# the body types a cross-site form or a no-cors fetch may send without a preflight
SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
ALLOWED_HOSTS_ENV = "MLX_GATEWAY_ALLOWED_HOSTS"


def is_loopback(host: str) -> bool:
    """A loopback address (an IPv4-mapped one too), or the name localhost."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower().rstrip(".") == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def host_name(header: str) -> str:
    """The name a Host header names: no port, no IPv6 brackets, no trailing dot, lower case."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostPolicy:
    """The Host names a server answers to (see the module's note)."""

    names: frozenset[str] = frozenset()
    any_ip: bool = False  # any IP address, as a client on the network dials it
    enforced: bool = True

    @classmethod
    def of(cls, settings: ServerSettings) -> HostPolicy:
        given = {host_name(h) for h in settings.allowed_hosts if h.strip()}
        loopback = is_loopback(settings.host)
        enforced = "*" not in given and (loopback or settings.api_key is None or bool(given))
        names = frozenset({*LOOPBACK_NAMES, host_name(settings.host), *given})
        return cls(names, any_ip=not loopback, enforced=enforced)

    def allows(self, header: str | None) -> bool:
        if not self.enforced or header is None:  # no Host at all: not a browser
            return True
        name = host_name(header)
        return name in self.names or (self.any_ip and _is_ip(name))

    def refusal(self, header: str) -> Forbidden:
        shown = header[:100]
        name = host_name(header)[:100] or "NAME"
        listed = ", ".join(f"[{n}]" if ":" in n else n for n in sorted(self.names))
        return Forbidden(
            f"This server does not answer to the Host {shown!r}: it answers {listed}"
            + (" and IP addresses" if self.any_ip else "")
            + ", so that a web page cannot reach it through a name it controls (DNS "
            f"rebinding). To reach it through a proxy or tunnel, start it with "
            f"--allowed-hosts {name} (or ${ALLOWED_HOSTS_ENV}).",
            code="host_not_allowed",
        )


def media_type(headers: Headers) -> str | None:
    value = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return value or None


def body_type_refusal(method: str, headers: Headers) -> UnsupportedMediaType | None:
    """A 415 for a POST whose body a browser could have sent cross-site unasked."""
    if method != "POST":
        return None
    media = media_type(headers)
    if media in SIMPLE_TYPES:
        said = f"a {media} body"
    elif media is None and "origin" in headers:
        said = "a body with no Content-Type from a browser"
    else:
        return None
    return UnsupportedMediaType(
        f"This server takes JSON: send the body as 'Content-Type: application/json' "
        f"(got {said}, which any web page may send here unasked).",
        code="unsupported_media_type",
    )


def is_local_only(path: str) -> bool:
    """The pages that show other clients' requests or the server's own state."""
    return path.rstrip("/") == "/metrics" or path == "/debug" or path.startswith("/debug/")


def local_refusal(path: str, client: tuple[str, int] | None) -> Forbidden | None:
    """Without an API key, /metrics and /debug/* answer only clients on this machine (a
    Unix socket has no client address: it is on this machine)."""
    if not is_local_only(path) or client is None or is_loopback(client[0]):
        return None
    return Forbidden(
        f"{path} answers only clients on this machine while the server has no API key; "
        "start it with --api-key to read it from elsewhere (the key is then required).",
        code="local_only",
    )


class ExposureMiddleware:
    """Refuses, in the dialect of the path, what the module's note says is not for this
    server; everything else goes on to the app."""

    def __init__(self, app: ASGIApp, *, settings: ServerSettings) -> None:
        self.app = app
        self.hosts = HostPolicy.of(settings)
        self.keyed = settings.api_key is not None

    def refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is not None and not self.hosts.allows(host):
            log.info("refused a request to the Host %r", host[:100])
            return self.hosts.refusal(host)
        if not self.keyed:  # with a key, the key guards the local pages
            client = scope.get("client")
            local = local_refusal(scope["path"], tuple(client) if client else None)
            if local is not None:
                return local
        return body_type_refusal(scope["method"], headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self.refusal(scope)
        if err is None:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        response = JSONResponse(err.body_for(path), status_code=err.status, headers=err.headers)
        await response(scope, receive, send)
