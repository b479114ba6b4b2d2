"""The engine: exactly one worker thread owns MLX and serves the queued requests.

Requests wait in a bounded queue. Each request gets a handle whose events (text
deltas, then one Finished) can be consumed from asyncio or from a plain thread.
Cancelling a handle (a client went away) stops its work within one prefill chunk
or one decode step. A `BatchRunner` (runtime/runner.py) takes requests from the queue
whenever its running batch has room and steps them together; a plain `Runner`
serves one request at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from runtime.types import (
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    GenerationStats,
)

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The engine's request queue is at capacity; retry later."""


class EngineStopped(Exception):
    """The engine is not running."""


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


class _ThreadSink:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()

    def put(self, event: GenerationEvent) -> None:
        self.queue.put(event)


class RequestHandle:
    """The caller's side of one request: iterate its events, or cancel it."""

    def __init__(self, request: GenerationRequest, sink: _AsyncSink | _ThreadSink) -> None:
        self.request = request
        self._sink = sink
        self._cancel = threading.Event()
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _emit(self, event: GenerationEvent) -> None:
        self._sink.put(event)

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
        assert isinstance(sink, _ThreadSink), "submit() from asyncio gives an async handle"
        while True:
            event = sink.queue.get()
            yield event
            if isinstance(event, Finished):
                return


@dataclass
class EngineStats:
    """Counters the worker updates; read them for /health and metrics."""

    requests_total: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    busy: bool = False
    # the running batch, for a BatchRunner (sequences decoding, prompts being read,
    # decode steps taken and their running average duration)
    running: int = 0
    prefilling: int = 0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0


class Runner(Protocol):
    """Serves one request from start to finish."""

    def run(self, handle: RequestHandle) -> Finished: ...


class BatchRunner(Protocol):
    """Serves many requests at once (runtime.runner.ModelRunner): `admit` takes one in
    (raising if it cannot run), `step` advances them all and returns those that ended."""

    @property
    def idle(self) -> bool: ...
    def has_room(self) -> bool: ...
    def admit(self, handle: RequestHandle) -> None: ...
    def step(self) -> list[tuple[RequestHandle, Finished]]: ...
    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]: ...
    def load(self) -> tuple[int, int, int, float]:
        """(running, prefilling, decode steps taken, average decode step seconds)."""
        ...


class Engine:
    def __init__(self, runner: Runner | BatchRunner, *, max_queue: int = 64) -> None:
        self._runner = runner
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue(maxsize=max(1, max_queue))
        self._thread: threading.Thread | None = None
        # submitters only add to the queue and the worker only removes, so a free-space
        # check under this lock makes a group submission all-or-nothing
        self._submit_lock = threading.RLock()
        self.stats = EngineStats()

    # lifecycle -------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._work, name="mlx-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._drain()
        self._queue.put(None)
        thread.join(timeout)
        close = getattr(self._runner, "close", None)
        if close is not None and not thread.is_alive():
            # MLX arrays left for interpreter shutdown abort the process ("terminate
            # called without an active exception"): release them while MLX is up
            close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def capacity(self) -> int:
        """How many requests may wait at once."""
        return self._queue.maxsize

    # submission --------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; from asyncio the handle is async-iterable, else iterable."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        sink: _AsyncSink | _ThreadSink
        try:
            sink = _AsyncSink(asyncio.get_running_loop())
        except RuntimeError:
            sink = _ThreadSink()
        handle = RequestHandle(request, sink)
        with self._submit_lock:
            try:
                self._queue.put_nowait(handle)
            except queue.Full:
                raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None
        return handle

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Queue several requests back to back, all or none (the n choices of one API
        request): QueueFull when they do not all fit."""
        with self._submit_lock:
            free = self._queue.maxsize - self._queue.qsize()
            if len(requests) > free:
                raise QueueFull(
                    f"{len(requests)} generations asked, {free} of {self._queue.maxsize} "
                    "queue places free"
                )
            return [self.submit(r) for r in requests]

    # worker ------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                return
            if handle is not None:
                handle._emit(_finished(handle, FinishReason.CANCELLED, "server shutting down"))

    def _work(self) -> None:
        runner = self._runner
        if not _is_batch_runner(runner):
            while True:
                handle = self._queue.get()
                if handle is None:
                    return
                self._serve(handle)
        try:
            self._work_batched(cast(BatchRunner, runner))
        except BaseException:
            log.exception("the engine's worker stopped")
            raise

    def _work_batched(self, runner: BatchRunner) -> None:
        stats = self.stats
        while True:
            stats.busy = not runner.idle
            while runner.idle or runner.has_room():
                try:
                    handle = self._queue.get(block=runner.idle)
                except queue.Empty:
                    break
                if handle is None:
                    for h, done in runner.abort(FinishReason.CANCELLED, "server shutting down"):
                        self._complete(h, done)
                    return
                self._admit(runner, handle)
            stats.busy = not runner.idle
            if not runner.idle:
                for h, done in runner.step():
                    self._complete(h, done)
            stats.running, stats.prefilling, stats.decode_steps, stats.decode_step_seconds = (
                runner.load()
            )

    def _admit(self, runner: BatchRunner, handle: RequestHandle) -> None:
        self.stats.requests_total += 1
        if handle.cancelled:
            self.stats.requests_cancelled += 1
            handle._emit(_finished(handle, FinishReason.CANCELLED))
            return
        try:
            runner.admit(handle)
        except Exception as exc:  # this request cannot run; the others go on
            log.info("request refused: %s", exc)
            self._complete(
                handle, _finished(handle, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
            )

    def _complete(self, handle: RequestHandle, done: Finished) -> None:
        stats = self.stats
        if done.reason is FinishReason.CANCELLED:
            stats.requests_cancelled += 1
        elif done.reason is FinishReason.ERROR:
            stats.requests_failed += 1
        stats.prompt_tokens_total += done.stats.prompt_tokens
        stats.completion_tokens_total += done.stats.completion_tokens
        handle._emit(done)

    def _serve(self, handle: RequestHandle) -> None:
        stats = self.stats
        stats.requests_total += 1
        if handle.cancelled:
            stats.requests_cancelled += 1
            handle._emit(_finished(handle, FinishReason.CANCELLED))
            return
        stats.busy = True
        try:
            done = cast(Runner, self._runner).run(handle)
        except Exception as exc:  # one request's failure must never kill the worker
            log.exception("request failed")
            stats.requests_failed += 1
            done = _finished(handle, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            stats.busy = False
        if done.reason is FinishReason.CANCELLED:
            stats.requests_cancelled += 1
        stats.prompt_tokens_total += done.stats.prompt_tokens
        stats.completion_tokens_total += done.stats.completion_tokens
        handle._emit(done)


def _is_batch_runner(runner: object) -> bool:
    return all(hasattr(runner, name) for name in ("admit", "step", "has_room", "abort"))


def _finished(handle: RequestHandle, reason: FinishReason, error: str | None = None) -> Finished:
    stats = GenerationStats(prompt_tokens=len(handle.request.prompt_tokens), completion_tokens=0)
    return Finished(reason, stats, error)
