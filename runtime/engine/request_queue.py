"""The engine's requests from the caller's side: the bounded queue they wait in, the ones
submitted and not yet ended, and the one way a request ends (`RequestQueue.finish`).

Submitters only add to the queue and the worker only removes, so a free-space check
under the submit lock makes a group submission all-or-nothing (`room_for`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator

from runtime.batch import RequestHandle, open_handle
from runtime.engine.types import EngineFailure, EngineStats, QueueFull
from runtime.types import Finished, FinishReason, GenerationRequest, GenerationStats

SHUTTING_DOWN = "server shutting down"


class RequestQueue:
    """The queued requests (the worker takes them) and every submitted, unfinished one.

    `lock` is the engine's lifecycle lock: ending requests while the watchdog holds it
    (a failed worker's requests) keeps the same order as before the split."""

    def __init__(self, max_queue: int, stats: EngineStats, lock: threading.RLock) -> None:
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue(maxsize=max(1, max_queue))
        self._submit_lock = threading.RLock()
        self._lock = lock
        self._live: set[RequestHandle] = set()
        self._stats = stats

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished (queued or running)."""
        with self._lock:
            return len(self._live)

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    @property
    def capacity(self) -> int:
        return self._queue.maxsize

    # the callers' side -----------------------------------------------------------
    def put(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request (QueueFull when the queue is at capacity)."""
        handle = open_handle(request)
        with self._submit_lock:
            with self._lock:
                self._live.add(handle)  # before the worker can see it (and finish it)
            try:
                self._queue.put_nowait(handle)
            except queue.Full:
                with self._lock:
                    self._live.discard(handle)
                raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None
        return handle

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        """Hold other submissions off while `count` requests go in: QueueFull when they
        do not all fit."""
        with self._submit_lock:
            free = self._queue.maxsize - self._queue.qsize()
            if count > free:
                raise QueueFull(
                    f"{count} generations asked, {free} of {self._queue.maxsize} queue places free"
                )
            yield

    # the worker's side -----------------------------------------------------------
    def get(self, timeout: float) -> RequestHandle | None:
        """The next request, waiting up to `timeout` (queue.Empty); None: the worker leaves."""
        return self._queue.get(timeout=timeout)

    def get_nowait(self) -> RequestHandle | None:
        return self._queue.get_nowait()

    def stop_worker(self) -> None:
        """Ask the worker to leave once it reaches this point in the queue."""
        self._queue.put(None)

    # ending requests ---------------------------------------------------------------
    def finish(self, handle: RequestHandle, done: Finished) -> None:
        """The one way a request ends: deliver `done` unless it already ended."""
        if not handle.finish(done):
            return
        with self._lock:
            self._live.discard(handle)
            stats = self._stats
            if done.reason is FinishReason.CANCELLED:
                stats.requests_cancelled += 1
            elif done.reason is FinishReason.ERROR:
                stats.requests_failed += 1
            stats.prompt_tokens_total += done.stats.prompt_tokens
            stats.completion_tokens_total += done.stats.completion_tokens

    def end_all(self, make: Callable[[RequestHandle], Finished]) -> int:
        """End every queued and running request with `make(handle)` from any thread (no
        MLX: the worker drops their work when it sees them cancelled)."""
        with self._lock:
            handles = list(self._live)
        for handle in self._take_queued():
            if handle not in handles:
                handles.append(handle)
        for handle in handles:
            self.finish(handle, make(handle))
            handle.cancel()
        return len(handles)

    def fail_all(self, message: str) -> None:
        """End every request with an EngineFailure (the engine failed under them)."""
        self.end_all(lambda h: failure(h, message))

    def cancel_queued(self) -> None:
        """End the requests still waiting (shutdown); the running ones go on."""
        for handle in self._take_queued():
            self.finish(handle, ending(handle, FinishReason.CANCELLED, SHUTTING_DOWN))

    def _take_queued(self) -> list[RequestHandle]:
        taken: list[RequestHandle] = []
        stop = False
        while True:
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                break
            if handle is None:
                stop = True
            else:
                taken.append(handle)
        if stop:
            self._queue.put(None)  # a stop() under way still needs its sentinel
        return taken


def handle_stats(handle: RequestHandle) -> GenerationStats:
    """What a request did so far, as its handle counted it."""
    return GenerationStats(
        prompt_tokens=len(handle.request.prompt_tokens), completion_tokens=handle.tokens_out
    )


def ending(handle: RequestHandle, reason: FinishReason, error: str | None = None) -> Finished:
    """A Finished for a request the engine ends itself (cancelled, refused, shut down)."""
    return Finished(reason, handle_stats(handle), error)


def failure(
    handle: RequestHandle, error: str, stats: GenerationStats | None = None
) -> EngineFailure:
    """How a request ends when the engine failed under it (worth retrying)."""
    return EngineFailure(FinishReason.ERROR, stats or handle_stats(handle), error)
