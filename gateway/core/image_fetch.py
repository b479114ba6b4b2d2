"""An image's bytes from its source: a data: URL, or an http(s) URL fetched under limits.

Fetching refuses what a server should not reach on a client's behalf: schemes other
than http and https (redirect targets included), and hosts that resolve to anything but
public addresses (loopback, private, link-local, ...) unless the policy allows them. The
connection goes to the address that was checked, so a second DNS answer cannot swap it.

One wall-clock deadline covers a fetch, redirects included: resolving, connecting, the
TLS handshake, the headers and the body. A socket timeout bounds each read, not their
sum (a server dripping a byte a second would hold the worker thread for days), so a
timer shuts the connection down at the deadline and the blocked read returns at once.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from runtime.vision import (
    ImageError,
    ImageLimits,
    ImageTooLarge,
)

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_READ = 64 * 1024


class ImageFetchError(ImageError):
    code = "image_fetch_failed"


@dataclass(frozen=True)
class ImagePolicy:
    """Limits on a request's images, and how URLs are fetched."""

    limits: ImageLimits = field(default_factory=ImageLimits)
    fetch_timeout: float = 15.0  # seconds for one image, redirects included
    max_redirects: int = 3
    allow_private: bool = False  # fetch from loopback, private and link-local hosts


def read_source(source: str, policy: ImagePolicy, used: int = 0) -> bytes:
    """An image's encoded bytes; `used`: bytes the request's earlier images took."""
    limits = policy.limits
    room = min(limits.max_bytes, limits.max_total_bytes - used)
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        data = read_data_url(source, room)
    elif scheme in ("http", "https"):
        data = fetch(source, policy, room)
    else:
        raise ImageFetchError("an image's URL must be an http(s) URL or a data: URL")
    limits.check_bytes(len(data), used + len(data))
    return data


def read_data_url(url: str, room: int) -> bytes:
    """The bytes of a base64 data: URL, refusing more than `room` before decoding."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ImageError("a data: URL needs a comma before its data")
    params = [p.strip().lower() for p in header.split(";")]
    media = params[0]
    if media and not media.startswith("image/"):
        raise ImageError(f"the data: URL's media type is {media!r}, not an image type")
    if "base64" not in params[1:]:
        raise ImageError("an image data: URL must be base64 (data:image/png;base64,...)")
    compact = "".join(payload.split())
    if len(compact) // 4 * 3 > room:
        raise ImageTooLarge(f"the image is over {room} bytes, the most accepted")
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's data is not valid base64") from None


# -- fetching -------------------------------------------------------------------------


class Deadline:
    """A fetch's one deadline. Resolving and connecting get the time left; a connection
    it watches is shut down when it passes, which ends a blocked read or handshake."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._watched: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def error(self) -> ImageFetchError:
        return ImageFetchError(
            f"fetching it took longer than {self.seconds:g} s (resolving, connecting, "
            "headers and body together)"
        )

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0 or self.expired:
            raise self.error()
        return left

    def watch(self, sock: socket.socket) -> None:
        """Shut `sock`'s connection down at the deadline. A shutdown acts on the
        connection whichever descriptor names it: a duplicate outlives the TLS wrap,
        which detaches the original."""
        dup = sock.dup()
        with self._lock:
            self._watched.append(dup)
            late = self.expired
        if late:
            _shut(dup)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            watched = list(self._watched)
        for sock in watched:
            _shut(sock)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            watched, self._watched = self._watched, []
        for sock in watched:
            sock.close()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # not connected, or closed already: nothing to end
        sock.shutdown(socket.SHUT_RDWR)


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to an already checked address (Host header still the name)."""

    def __init__(self, host: str, port: int, address: str, deadline: Deadline) -> None:
        super().__init__(host, port, timeout=deadline.left())
        self._address = address
        self._deadline = deadline

    def _dial(self) -> socket.socket:
        sock = socket.create_connection((self._address, self.port), self._deadline.left())
        self._deadline.watch(sock)
        return sock

    def connect(self) -> None:
        self.sock = self._dial()


class _PinnedHTTPS(_PinnedHTTP, http.client.HTTPSConnection):
    """An HTTPS connection to an already checked address; the certificate is verified
    against the host name (SNI and hostname check)."""

    def __init__(self, host: str, port: int, address: str, deadline: Deadline) -> None:
        super().__init__(host, port, address, deadline)
        self._tls = ssl.create_default_context()

    def connect(self) -> None:
        self.sock = self._tls.wrap_socket(self._dial(), server_hostname=self.host)


# IPv6 ranges that carry an IPv4 address in their last 32 bits (NAT64, IPv4-compatible)
_CARRY_V4 = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48", "::/96"))


def _public(address: str) -> bool:
    """A global unicast address; an IPv6 one that carries an IPv4 address (mapped,
    6to4, NAT64) only if that one is too."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return _public(str(ip.ipv4_mapped))
        inner = ip.sixtofour
        if inner is None and any(ip in net for net in _CARRY_V4):
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
        if inner is not None and not _public(str(inner)):
            return False
    return ip.is_global and not ip.is_multicast


def _lookup(host: str, port: int, deadline: Deadline) -> list[str]:
    """The host's addresses. A resolver cannot be interrupted: it asks on a thread of
    its own, left to finish (the resolver's own timeout ends it) if the deadline passes."""
    found: list[str] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def ask() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            found.extend(str(info[4][0]) for info in infos)
        except (OSError, UnicodeError) as exc:
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=ask, name="image-fetch-dns", daemon=True).start()
    if not done.wait(deadline.left()):
        raise deadline.error()
    if failed:
        raise ImageFetchError(f"the host {host!r} could not be resolved ({failed[0]})")
    return found


def _resolve(host: str, port: int, policy: ImagePolicy, deadline: Deadline) -> str:
    """The address to connect to: every address the name has must be allowed."""
    addresses = _lookup(host, port, deadline)
    if not addresses:
        raise ImageFetchError(f"the host {host!r} has no address")
    if not policy.allow_private and not all(_public(a) for a in addresses):
        raise ImageFetchError(
            f"the host {host!r} is a loopback, private or link-local address; this server "
            "fetches images from public hosts only (send the image as a data: URL, or "
            "start the server with --allow-private-urls)"
        )
    return addresses[0]


def fetch(url: str, policy: ImagePolicy, room: int) -> bytes:
    """GET an image over http(s), following a few redirects (each target checked), at
    most `room` bytes, within the policy's time (one deadline for all of it)."""
    deadline = Deadline(policy.fetch_timeout)
    try:
        return _follow(url, policy, room, deadline)
    except (OSError, http.client.HTTPException) as exc:
        if deadline.expired:  # the watchdog ended the connection
            raise deadline.error() from None
        raise ImageFetchError(f"it could not be fetched ({type(exc).__name__}: {exc})") from None
    finally:
        deadline.close()


def _follow(url: str, policy: ImagePolicy, room: int, deadline: Deadline) -> bytes:
    for _ in range(policy.max_redirects + 1):
        conn = _connect(url, policy, deadline)
        try:
            response = _get(conn, url)
            if response.status in _REDIRECTS:
                location = response.getheader("Location")
                if not location:
                    raise ImageFetchError(f"HTTP {response.status} without a Location")
                url = urljoin(url, location)
                continue
            if response.status != 200:
                raise ImageFetchError(f"fetching it answered HTTP {response.status}")
            return _read_capped(response, room, deadline)
        finally:
            conn.close()
    raise ImageFetchError(f"fetching it took more than {policy.max_redirects} redirects")


def _connect(url: str, policy: ImagePolicy, deadline: Deadline) -> http.client.HTTPConnection:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ImageFetchError("the image URL is malformed") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ImageFetchError("an image URL (or its redirect) must be http or https")
    host = parts.hostname
    if not host:
        raise ImageFetchError("the image URL has no host")
    port = port or (443 if scheme == "https" else 80)
    address = _resolve(host, port, policy, deadline)
    pinned = _PinnedHTTPS if scheme == "https" else _PinnedHTTP
    return pinned(host, port, address, deadline)


def _get(conn: http.client.HTTPConnection, url: str) -> http.client.HTTPResponse:
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {"User-Agent": "mlx-gateway", "Accept": "image/*"}
    conn.request("GET", target, headers=headers)
    return conn.getresponse()


def _read_capped(response: http.client.HTTPResponse, room: int, deadline: Deadline) -> bytes:
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > room:
        raise ImageTooLarge(f"the image is {length} bytes; at most {room} are accepted")
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = response.read(_READ)
        if deadline.expired:  # a shut-down connection reads as its end: not the image's
            raise deadline.error()
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > room:
            raise ImageTooLarge(f"the image is over {room} bytes, the most accepted")
        chunks.append(chunk)
