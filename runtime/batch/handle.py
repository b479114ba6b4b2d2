"""The caller's side of one engine request: its events (text deltas, then exactly one
Finished) as an async or a plain iterator, and its cancel flag.

The engine delivers a request's Finished once: a later one (the worker's, after the
watchdog or a shutdown already ended the request) is dropped, so a consumer always
sees one ending.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

from runtime.types import Finished, GenerationEvent, GenerationRequest


class _Sink(Protocol):
    def put(self, event: GenerationEvent) -> None: ...


class _AsyncSink:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()

    def put(self, event: GenerationEvent) -> None:
        # the loop may have closed under us: then nobody is listening
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class ThreadSink:
    """Events for a consumer on a plain thread (or for nobody: a replica's handle)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()

    def put(self, event: GenerationEvent) -> None:
        self.queue.put(event)


class RequestHandle:
    """The caller's side of one request: iterate its events, or cancel it."""

    def __init__(self, request: GenerationRequest, sink: _AsyncSink | ThreadSink) -> None:
        self.request = request
        self._sink = sink
        self._cancel = threading.Event()
        self.submitted_at = time.perf_counter()
        self.tokens_out = 0  # completion tokens delivered so far
        self._done: Finished | None = None
        self._done_lock = threading.Lock()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done is not None

    def emit(self, event: GenerationEvent) -> None:
        if isinstance(event, Finished):
            self.finish(event)
        elif self._done is None:
            self.tokens_out += len(event.token_ids)
            self._sink.put(event)

    def finish(self, done: Finished) -> bool:
        """Deliver the request's one Finished; a later one (the worker's, after the
        watchdog or a shutdown already ended the request) is dropped."""
        with self._done_lock:
            if self._done is not None:
                return False
            self._done = done
        self._sink.put(done)
        return True

    async def __aiter_impl(self) -> AsyncIterator[GenerationEvent]:
        sink = self._sink
        assert isinstance(sink, _AsyncSink), "submit() from a thread gives a sync handle"
        while True:
            event = await sink.queue.get()
            yield event
            if isinstance(event, Finished):
                return

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self.__aiter_impl()

    def __iter__(self) -> Iterator[GenerationEvent]:
        sink = self._sink
        assert isinstance(sink, ThreadSink), "submit() from asyncio gives an async handle"
        while True:
            event = sink.queue.get()
            yield event
            if isinstance(event, Finished):
                return


def open_handle(request: GenerationRequest) -> RequestHandle:
    """A handle for the calling context: async-iterable when called from asyncio (its
    events cross into the loop thread-safely), else a plain iterator."""
    sink: _AsyncSink | ThreadSink
    try:
        sink = _AsyncSink(asyncio.get_running_loop())
    except RuntimeError:
        sink = ThreadSink()
    return RequestHandle(request, sink)
