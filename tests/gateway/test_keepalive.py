"""Keepalives in a stream (gateway/core/keepalive.py): sent while the next item is late,
never after the last one; closing the stream closes its items' generator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sse_starlette import ServerSentEvent

from gateway.anthropic.routes import ping_event
from gateway.core.keepalive import with_keepalives


def test_keepalives_while_idle_and_none_after_the_end() -> None:
    async def run() -> list[object]:
        gate = asyncio.Event()

        async def items() -> AsyncIterator[str]:
            yield "message_start"
            await gate.wait()  # the model is prefilling
            yield "message_stop"

        out: list[object] = []
        stream = with_keepalives(items(), 0.01, ping_event)
        async for item in stream:
            out.append(item)
            if isinstance(item, ServerSentEvent):
                gate.set()  # a keepalive came while the stream waited: let it finish
        return out

    out = asyncio.run(run())
    assert out[0] == "message_start" and out[-1] == "message_stop"
    pings = out[1:-1]
    assert pings and all(isinstance(p, ServerSentEvent) and p.event == "ping" for p in pings)


def test_a_prompt_stream_sends_no_keepalive() -> None:
    async def run() -> list[object]:
        async def items() -> AsyncIterator[int]:
            for i in range(3):
                yield i

        return [item async for item in with_keepalives(items(), 60.0)]

    assert asyncio.run(run()) == [0, 1, 2]


def test_closing_the_stream_closes_its_items() -> None:
    """The client went away while the stream waited for its next item: the wait stops
    and the items' generator runs its cleanup (the route's cancels the generations)."""

    async def run() -> list[str]:
        seen: list[str] = []
        never = asyncio.Event()

        async def items() -> AsyncIterator[str]:
            try:
                yield "first"
                await never.wait()
                yield "never"
            finally:
                seen.append("closed")

        stream = with_keepalives(items(), 0.01)
        assert await anext(stream) == "first"
        assert isinstance(await anext(stream), ServerSentEvent)  # waiting: a keepalive
        await stream.aclose()  # type: ignore[attr-defined]
        return seen

    assert asyncio.run(run()) == ["closed"]
