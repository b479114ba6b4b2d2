"""A bound on how long a request's head (request line and headers) may take to arrive.

uvicorn bounds the idle time between requests on a kept-alive connection, but not a
connection that sends nothing, nor one that trickles its headers a byte at a time
(slowloris): each would hold a connection, and its memory, for as long as the client
likes. The request body has its own bound (`ServerSettings.body_timeout_seconds`,
gateway/core/http.py); this is the one before it. A head that is not complete in time
gets a 408 and the connection closes; nothing reached the app.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.server.linger import LingeringTransport

_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late, and
    lingering on a close while its client is still sending (gateway/server/linger.py)."""

    head_timeout = 30.0  # seconds; set by `head_deadline_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._linger = LingeringTransport(transport, self)
        super().connection_made(self._linger)  # type: ignore[arg-type]
        self._arm_head()

    def unread_input(self) -> bool:
        """Whether the client may still be sending: a body not read to its end, a
        request that broke the protocol, or bytes of a head not yet complete."""
        pending, _ = self.conn.trailing_data
        return self.conn.their_state in (h11.SEND_BODY, h11.ERROR) or bool(pending)

    def data_received(self, data: bytes) -> None:
        if self._linger.lingering:
            return  # the answer went out: what the client still sends is dropped
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting:
            self._arm_head()  # a new request's first bytes (the idle timer stops here)
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # its head arrived: the body has its own bound
            self._disarm_head()

    def eof_received(self) -> None:
        if self._linger.lingering:
            self._linger.abort_linger()  # the client has closed its side too
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head()
        self._linger.lost()
        super().connection_lost(exc)

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not (self.cycle is None or self.cycle.response_complete):
            return
        text = f"the request's headers did not arrive within {self.head_timeout:g} s\n".encode()
        self.transport.write(_TIMEOUT_408 % (len(text), text))
        self.transport.close()


def head_deadline_protocol(seconds: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn's `http=`, with heads bounded to `seconds`."""
    if seconds <= 0:
        raise ValueError("the head timeout must be positive")
    return type("HeadDeadline", (HeadDeadlineProtocol,), {"head_timeout": float(seconds)})
