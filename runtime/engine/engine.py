"""The engine: exactly one worker thread owns MLX and serves the queued requests.

Requests wait in a bounded queue. Each request gets a handle (runtime/batch/handle.py) whose
events can be consumed from asyncio or from a plain thread. Cancelling a handle (a
client went away) stops its work within one prefill chunk or one decode step. A
`BatchRunner` (runtime/engine/runner.py) takes requests from the queue whenever its running
batch has room and steps them together; a plain `Runner` serves one request at a time.

A watchdog (`watch()`, started by the server) keeps the engine serving. The worker
records a heartbeat at every step, admission and idle poll. If the worker dies (an
exception escaped its loop), every queued and running request ends with an
`EngineFailure` and a fresh worker starts after a short delay, first resetting the
runner: `abort` drops the batch and the prefix cache's open lease, and `close` every
cached array (MLX graphs and streams belong to the thread that made them, so nothing
the dead worker left unevaluated can be used by another); the model stays loaded.

If the worker makes no step for `stall_seconds` while it has work, its requests fail
the same way and it is abandoned: a Python thread cannot be killed and it may be inside
an MLX call, so no second worker starts while it runs. When its step returns it sees it
was abandoned, resets the runner and leaves; then a fresh worker starts.

`halt(reason)` ends it for good (a distributed group lost a rank: no fresh worker can
serve): every request fails now, new ones are refused, /health shows `reason`, and a
worker stuck in a step is abandoned. A batch runner may also offer `tick()`, which an idle
worker calls at every poll (a distributed group's rank 0 heartbeats its followers there).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import cast

from runtime import backend
from runtime.batch.handle import RequestHandle as RequestHandle
from runtime.batch.handle import open_handle
from runtime.engine.types import BatchRunner as BatchRunner
from runtime.engine.types import EngineFailure as EngineFailure
from runtime.engine.types import EngineHealth as EngineHealth
from runtime.engine.types import EngineState as EngineState
from runtime.engine.types import EngineStats as EngineStats
from runtime.engine.types import EngineStopped as EngineStopped
from runtime.engine.types import EngineUnavailable as EngineUnavailable

# re-exported: the engine's API
from runtime.engine.types import QueueFull as QueueFull
from runtime.engine.types import Runner as Runner
from runtime.types import Finished, FinishReason, GenerationRequest, GenerationStats

log = logging.getLogger(__name__)

DEFAULT_STALL_SECONDS = 300.0  # a CPU prefill chunk of a long prompt can take minutes
_IDLE_POLL_S = 1.0  # an idle worker wakes this often, so its heartbeat stays fresh
_MAX_RESTART_DELAY_S = 60.0
SHUTTING_DOWN = "server shutting down"


class Engine:
    def __init__(
        self,
        runner: Runner | BatchRunner,
        *,
        max_queue: int = 64,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        restart_delay: float = 1.0,
    ) -> None:
        self._runner = runner
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue(maxsize=max(1, max_queue))
        self._thread: threading.Thread | None = None
        # submitters only add to the queue and the worker only removes, so a free-space
        # check under this lock makes a group submission all-or-nothing
        self._submit_lock = threading.RLock()
        self.stats = EngineStats()
        self.stall_seconds = stall_seconds  # no step for this long, with work: stalled
        self.restart_delay = restart_delay  # before the first restart; doubles per failure
        # the lifecycle, the submitted-and-unfinished handles, the watchdog's records
        self._lock = threading.RLock()
        self._phase = EngineState.STOPPED  # STOPPED, RUNNING, FAILED or STALLED
        self._draining = False
        self._generation = 0  # bumped per worker: an abandoned one sees it changed
        self._abandoned: threading.Thread | None = None
        self._live: set[RequestHandle] = set()
        self._beat = time.monotonic()
        self._restart_at = 0.0
        self._streak = 0  # failures since a request last finished well
        self._restarts = 0
        self._failures = 0
        self._last_failure: str | None = None
        self._halted: str | None = None  # why the engine stopped for good (see halt)
        self._watcher: threading.Thread | None = None
        self._unwatch = threading.Event()

    # lifecycle -------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._phase is not EngineState.STOPPED:
                return
            self._phase = EngineState.RUNNING
            self._draining = False
            self._spawn(recover=False)

    def watch(self) -> None:
        """Start the watchdog thread (the server's lifespan does, after `start`)."""
        with self._lock:
            if self._watcher is not None:
                return
            self._unwatch.clear()
            interval = min(0.5, max(0.02, self.stall_seconds / 10))
            self._watcher = threading.Thread(
                target=self._monitor, args=(interval,), name="mlx-engine-watchdog", daemon=True
            )
            self._watcher.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            abandoned, self._abandoned = self._abandoned, None
            watcher, self._watcher = self._watcher, None
            self._phase, self._draining = EngineState.STOPPED, False
        self._unwatch.set()
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout)
        if thread is None and abandoned is None:
            return
        self._drain()
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout)
        # what no worker ended (a stalled one's requests) ends here
        self._end_all(lambda h: _finished(h, FinishReason.CANCELLED, SHUTTING_DOWN))
        close = getattr(self._runner, "close", None)
        if close is not None and not any(
            t is not None and t.is_alive() for t in (thread, abandoned)
        ):
            # MLX arrays left for interpreter shutdown abort the process ("terminate
            # called without an active exception"): release them while MLX is up
            close()

    def drain(self) -> None:
        """Refuse new requests (EngineUnavailable); the queued and running ones go on."""
        with self._lock:
            if self._phase is not EngineState.STOPPED:
                self._draining = True

    def halt(self, reason: str) -> None:
        """Fail every request now and refuse new ones for good (from any thread): the
        runner can no longer serve, and no fresh worker would mend it (a distributed
        group lost a rank). A worker stuck in a step is abandoned; when its step
        returns it resets the runner and leaves."""
        with self._lock:
            if self._phase is EngineState.STOPPED or self._halted is not None:
                return
            log.error("the engine stops for good: %s", reason)
            self._halted = reason
            self._phase = EngineState.FAILED
            self._restart_at = math.inf
            if self._thread is not None:
                self._abandoned, self._thread = self._thread, None
            self._generation += 1
            self._record(reason)
            self._fail_all(f"the engine stopped: {reason}")

    def cancel_all(self, reason: str = SHUTTING_DOWN) -> int:
        """End every queued and running request now with Finished(CANCELLED, reason) (a
        shutdown's grace ran out); the worker drops their work within one step."""
        return self._end_all(lambda h: _finished(h, FinishReason.CANCELLED, reason))

    @property
    def running(self) -> bool:
        """Started and not stopped (the worker may be restarting: see `state`)."""
        return self._phase is not EngineState.STOPPED

    @property
    def state(self) -> EngineState:
        phase = self._phase
        if phase is EngineState.RUNNING and self._draining:
            return EngineState.DRAINING
        return phase

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished (queued or running)."""
        with self._lock:
            return len(self._live)

    def health(self) -> EngineHealth:
        with self._lock:
            stopped = self._phase is EngineState.STOPPED
            return EngineHealth(
                state=self.state,
                heartbeat_age=None if stopped else max(0.0, time.monotonic() - self._beat),
                busy=self.stats.busy,
                restarts=self._restarts,
                failures=self._failures,
                last_failure=self._last_failure,
            )

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
        self._check_open()
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

    def _check_open(self) -> None:
        state = self.state
        if state is EngineState.RUNNING:
            return
        if state is EngineState.STOPPED:
            raise EngineStopped("the engine is not running")
        if state is EngineState.DRAINING:
            raise EngineUnavailable("the server is shutting down", state)
        if self._halted is not None:
            raise EngineUnavailable(f"the engine stopped: {self._halted}", state)
        if state is EngineState.STALLED:
            message = (
                f"the engine stalled (no step for over {self.stall_seconds:g} s); it "
                "restarts when its stuck step returns"
            )
        else:
            message = f"the engine failed ({self._last_failure}) and is restarting"
        raise EngineUnavailable(message, state)

    # ending requests -----------------------------------------------------------
    def _finish(self, handle: RequestHandle, done: Finished) -> None:
        """The one way a request ends: deliver `done` unless it already ended."""
        if not handle._finish(done):
            return
        with self._lock:
            self._live.discard(handle)
            stats = self.stats
            if done.reason is FinishReason.CANCELLED:
                stats.requests_cancelled += 1
            elif done.reason is FinishReason.ERROR:
                stats.requests_failed += 1
            stats.prompt_tokens_total += done.stats.prompt_tokens
            stats.completion_tokens_total += done.stats.completion_tokens

    def _end_all(self, make: Callable[[RequestHandle], Finished]) -> int:
        """End every queued and running request with `make(handle)` from any thread (no
        MLX: the worker drops their work when it sees them cancelled)."""
        with self._lock:
            handles = list(self._live)
        for handle in self._take_queued():
            if handle not in handles:
                handles.append(handle)
        for handle in handles:
            self._finish(handle, make(handle))
            handle.cancel()
        return len(handles)

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

    def _drain(self) -> None:
        for handle in self._take_queued():
            self._finish(handle, _finished(handle, FinishReason.CANCELLED, SHUTTING_DOWN))

    # watchdog ------------------------------------------------------------------
    def _monitor(self, interval: float) -> None:
        while not self._unwatch.wait(interval):
            try:
                self._check()
            except Exception:  # the watchdog must outlive whatever it watches
                log.exception("engine watchdog check failed")

    def _check(self) -> None:
        """One watchdog pass: restart a dead or returned worker, abandon a stalled one."""
        now = time.monotonic()
        with self._lock:
            phase, thread = self._phase, self._thread
            if phase is EngineState.STOPPED:
                return
            if self._halted is not None:
                return  # for good: nothing to restart
            if phase is EngineState.STALLED:
                if self._abandoned is None or not self._abandoned.is_alive():
                    self._abandoned = None
                    self._respawn()
                return
            if thread is not None and thread.is_alive():
                silent = now - self._beat
                if phase is EngineState.RUNNING and self.stats.busy and silent > self.stall_seconds:
                    self._abandon(thread, silent)
                return
            if phase is EngineState.RUNNING:  # died without reporting it
                self._failed("the engine's worker thread ended")
                return
            if now >= self._restart_at:
                self._respawn()

    def _abandon(self, thread: threading.Thread, silent: float) -> None:
        log.error(
            "the engine's worker made no step for %.0f s (bound %g s): abandoning it; "
            "its requests fail and a fresh worker starts when its step returns",
            silent,
            self.stall_seconds,
        )
        self._phase = EngineState.STALLED
        self._abandoned, self._thread = thread, None
        self._generation += 1
        self._record(f"stalled: no step for {silent:.0f} s")
        self._fail_all(f"the engine stalled (no step for {silent:.0f} s) and is restarting")

    def _failed(self, error: str) -> None:
        """The current worker died: fail its requests; restart after a delay."""
        self._phase = EngineState.FAILED
        self._record(error)
        delay = min(self.restart_delay * 2 ** (self._streak - 1), _MAX_RESTART_DELAY_S)
        self._restart_at = time.monotonic() + delay
        log.error("the engine's worker failed (%s); restarting it in %.1f s", error, delay)
        self._fail_all(f"the engine's worker failed ({error}) and is restarting")

    def _record(self, error: str) -> None:
        self._failures += 1
        self._streak += 1
        self._last_failure = error

    def _fail_all(self, message: str) -> None:
        self._end_all(lambda h: _failure(h, message))

    def _respawn(self) -> None:
        self._phase = EngineState.RUNNING
        self._restarts += 1
        log.warning("starting a fresh engine worker (restart %d)", self._restarts)
        self._spawn(recover=True)

    # worker ------------------------------------------------------------------
    def _spawn(self, *, recover: bool) -> None:
        self._generation += 1
        self._beat = time.monotonic()
        self.stats.busy = False
        thread = threading.Thread(
            target=self._work_then_release,
            args=(self._generation, recover),
            name="mlx-engine",
            daemon=True,
        )
        self._thread = thread
        thread.start()

    def _current(self, generation: int) -> bool:
        return generation == self._generation

    def _work_then_release(self, generation: int, recover: bool) -> None:
        try:
            self._work(generation, recover)
        finally:
            backend.release_thread_streams()

    def _work(self, generation: int, recover: bool) -> None:
        runner = self._runner
        try:
            if not _is_batch_runner(runner):
                self._work_single(generation)
                return
            batch = cast(BatchRunner, runner)
            if recover:
                self._reset(batch)
            self._work_batched(batch, generation)
        except BaseException as exc:  # the watchdog restarts the worker
            if not self._current(generation):  # abandoned (stalled, halted): reported then
                log.info("an abandoned engine worker ended: %s: %s", type(exc).__name__, exc)
                return
            log.exception("the engine's worker stopped")
            with self._lock:
                if self._current(generation) and self._phase is EngineState.RUNNING:
                    self._failed(f"{type(exc).__name__}: {exc}")

    def _reset(
        self, runner: BatchRunner, done: Iterable[tuple[RequestHandle, Finished]] = ()
    ) -> None:
        """Drop the runner's batch after a failure (the requests in it were failed
        already, so their endings are dropped), then every MLX array it holds (`close`):
        an unevaluated graph, and the stream it runs on, belong to the thread that built
        them, so a fresh worker must not inherit them. The model stays loaded; the prefix
        cache starts empty."""
        ended = [*done, *runner.abort(FinishReason.ERROR, "the engine restarted")]
        for handle, finished in ended:
            self._finish(handle, _failure(handle, "the engine restarted", finished.stats))
        close = getattr(runner, "close", None)
        if close is not None:
            close()

    def _work_single(self, generation: int) -> None:
        while True:
            try:
                handle = self._queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                self._beat = time.monotonic()
                continue
            if handle is None:
                return
            self._beat = time.monotonic()
            self._serve(handle)
            self._beat = time.monotonic()
            if not self._current(generation):
                return  # abandoned mid-request: the watchdog starts a fresh worker

    def _work_batched(self, runner: BatchRunner, generation: int) -> None:
        stats = self.stats
        while True:
            if not self._current(generation):
                self._reset(runner)  # abandoned during an admission
                return
            stats.busy = not runner.idle
            if not self._admit_waiting(runner):
                for h, done in runner.abort(FinishReason.CANCELLED, SHUTTING_DOWN):
                    self._complete(h, done)
                return
            stats.busy = not runner.idle
            if not runner.idle:
                ended = runner.step()
                self._beat = time.monotonic()
                if not self._current(generation):
                    self._reset(runner, ended)  # abandoned during the step
                    return
                for h, done in ended:
                    self._complete(h, done)
            stats.running, stats.prefilling, stats.decode_steps, stats.decode_step_seconds = (
                runner.load()
            )

    def _admit_waiting(self, runner: BatchRunner) -> bool:
        """Take queued requests while the batch has room (waiting when it is idle);
        False when stop() asked the worker to leave."""
        while runner.idle or runner.has_room():
            try:
                if runner.idle:
                    handle = self._queue.get(timeout=_IDLE_POLL_S)
                else:
                    handle = self._queue.get_nowait()
            except queue.Empty:
                self._beat = time.monotonic()
                if runner.idle:
                    tick = getattr(runner, "tick", None)
                    if tick is None:
                        continue
                    tick()
                    return True  # back to the loop, which sees if this worker was abandoned
                return True
            if handle is None:
                return False
            self._beat = time.monotonic()
            self._admit(runner, handle)
            self._beat = time.monotonic()
        return True

    def _admit(self, runner: BatchRunner, handle: RequestHandle) -> None:
        self.stats.requests_total += 1
        if handle.cancelled:
            self._finish(handle, _finished(handle, FinishReason.CANCELLED))
            return
        try:
            runner.admit(handle)
        except Exception as exc:  # this request cannot run; the others go on
            log.info("request refused: %s", exc)
            self._complete(
                handle, _finished(handle, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
            )

    def _complete(self, handle: RequestHandle, done: Finished) -> None:
        if done.reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._streak = 0  # the engine works: the next failure restarts it quickly
        self._finish(handle, done)

    def _serve(self, handle: RequestHandle) -> None:
        stats = self.stats
        stats.requests_total += 1
        if handle.cancelled:
            self._finish(handle, _finished(handle, FinishReason.CANCELLED))
            return
        stats.busy = True
        try:
            done = cast(Runner, self._runner).run(handle)
        except Exception as exc:  # one request's failure must never kill the worker
            log.exception("request failed")
            done = _finished(handle, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            stats.busy = False
        self._complete(handle, done)


def _is_batch_runner(runner: object) -> bool:
    return all(hasattr(runner, name) for name in ("admit", "step", "has_room", "abort"))


def _stats(handle: RequestHandle) -> GenerationStats:
    return GenerationStats(
        prompt_tokens=len(handle.request.prompt_tokens), completion_tokens=handle.tokens_out
    )


def _finished(handle: RequestHandle, reason: FinishReason, error: str | None = None) -> Finished:
    return Finished(reason, _stats(handle), error)


def _failure(
    handle: RequestHandle, error: str, stats: GenerationStats | None = None
) -> EngineFailure:
    return EngineFailure(FinishReason.ERROR, stats or _stats(handle), error)
