"""Closing a connection whose client is still sending, without losing the answer.

A server that answers before it has read the whole request (a 408 for a trickled body,
a 503 for a connection too many, a 413) and then closes its socket with the client's
bytes unread makes the kernel reset the connection instead of ending it: the reset can
reach the client before it has read the answer, and its stack throws the answer away.
So such a close goes in two steps, as serious servers do ("lingering close"): the
answer is sent and the write side shut (the client sees the end of the response), the
client's further bytes are read and dropped until it closes its side or `LINGER_S`
pass, and only then does the socket close.
"""

from __future__ import annotations

import asyncio
from typing import Any

LINGER_S = 2.0  # seconds a closed connection keeps reading what its client still sends


class LingeringTransport:
    """A transport whose `close()` lingers while `owner.unread_input()` says the client
    may still be sending; everything else goes to the real transport."""

    def __init__(self, transport: asyncio.Transport, owner: Any) -> None:
        self._transport = transport
        self._owner = owner
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        real = self._transport
        if self.lingering or real.is_closing():
            return
        if not self._owner.unread_input() or not real.can_write_eof():
            real.close()
            return
        self.lingering = True
        real.write_eof()  # sent once the buffered answer is
        real.resume_reading()  # read and drop what still comes
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(LINGER_S, self.abort_linger)

    def abort_linger(self) -> None:
        """End the linger now (the client closed its side, or time is up)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.close()

    def lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
