"""Keepalives in a server-sent event stream, sent only while the stream has nothing else
to send.

sse-starlette's own ping fires on a timer beside the stream, whatever the stream is
doing: one could go out after a message's last event (an Anthropic `ping` after
`message_stop`, which Anthropic never sends) while the stream's generator was closing.
Here the stream's own iterator sends them: a keepalive when the next item has not come
within `seconds`, never once the items have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import ServerSentEvent

# what sse_response gives sse-starlette's own ping: never (about 34 years)
NO_TIMER_PING = 1 << 30


def comment() -> ServerSentEvent:
    """The default keepalive: an SSE comment, which clients skip."""
    return ServerSentEvent(comment="keepalive")


async def with_keepalives(
    items: AsyncIterator[Any],
    seconds: float,
    ping: Callable[[], ServerSentEvent] | None = None,
) -> AsyncIterator[Any]:
    """`items`, with `ping()` (an SSE comment by default) whenever the next item takes
    longer than `seconds`; `items` is closed when this is (the client went away)."""
    make = ping or comment
    it = aiter(items)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=seconds)
            if not done:
                yield make()
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # closed while waiting: stop the wait, then the items
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
