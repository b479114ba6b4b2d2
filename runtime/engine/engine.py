"""The engine: exactly one worker thread owns MLX and serves the queued requests.

Requests wait in a bounded queue. Each request gets a handle (runtime/batch/handle.py) whose
events can be consumed from asyncio or from a plain thread. Cancelling a handle (a
client went away) stops its work within one prefill chunk or one decode step. A
`BatchRunner` (runtime/engine/runner.py) takes requests from the queue whenever its running
batch has room and steps them together; a plain `Runner` serves one request at a time.
The parts: the queue (runtime/engine/request_queue.py), the worker's loop
(runtime/engine/worker.py), the watchdog (runtime/engine/watchdog.py); `Engine` is their face.

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

import threading
from collections.abc import Sequence

from runtime.batch import RequestHandle
from runtime.engine.request_queue import SHUTTING_DOWN, RequestQueue, ending
from runtime.engine.turns import Turns
from runtime.engine.types import (
    BatchRunner,
    EngineHealth,
    EngineState,
    EngineStats,
    EngineStopped,
    EngineUnavailable,
    Runner,
)
from runtime.engine.watchdog import Watchdog
from runtime.types import FinishReason, GenerationRequest

DEFAULT_STALL_SECONDS = 300.0  # a CPU prefill chunk of a long prompt can take minutes


class Engine:
    """The engine's face (see the module docstring): submission, state and health; the
    queue, the worker and the watchdog do the work."""

    def __init__(
        self,
        runner: Runner | BatchRunner,
        *,
        max_queue: int = 64,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        restart_delay: float = 1.0,
    ) -> None:
        self._runner = runner
        self.stats = EngineStats()
        # the lifecycle, the submitted-and-unfinished handles, the watchdog's records
        self._lock = threading.RLock()
        self._requests = RequestQueue(max_queue, self.stats, self._lock)
        self._watchdog = Watchdog(
            runner,
            self._requests,
            self.stats,
            self._lock,
            stall_seconds=stall_seconds,
            restart_delay=restart_delay,
        )
        self._draining = False

    @property
    def stall_seconds(self) -> float:
        """No step for this long, with work: the worker stalled."""
        return self._watchdog.stall_seconds

    @property
    def restart_delay(self) -> float:
        """Before the first restart; doubles per failure in a row."""
        return self._watchdog.restart_delay

    # lifecycle -------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._watchdog.phase is not EngineState.STOPPED:
                return
            self._draining = False
            self._watchdog.start()

    def take_turns(self, turns: Turns) -> None:
        """Share the cores with the server's other engines (runtime/engine/turns.py): a
        runner that offers `take_turns` (chat models' first, encoders' between their
        steps) gets `turns`; call it before `start`."""
        take = getattr(self._runner, "take_turns", None)
        if take is not None:
            take(turns)

    def watch(self) -> None:
        """Start the watchdog thread (the server's lifespan does, after `start`)."""
        self._watchdog.watch()

    def stop(self, timeout: float = 30.0) -> None:
        thread, abandoned = self._watchdog.stop(timeout)
        self._draining = False  # after the phase: the state reads STOPPED either way
        if thread is None and abandoned is None:
            return
        self._requests.cancel_queued()
        if thread is not None and thread.is_alive():
            self._requests.stop_worker()
            thread.join(timeout)
        # what no worker ended (a stalled one's requests) ends here
        self._requests.end_all(lambda h: ending(h, FinishReason.CANCELLED, SHUTTING_DOWN))
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
            if self._watchdog.phase is not EngineState.STOPPED:
                self._draining = True

    def halt(self, reason: str) -> None:
        """Fail every request now and refuse new ones for good (from any thread): the
        runner can no longer serve, and no fresh worker would mend it (a distributed
        group lost a rank). A worker stuck in a step is abandoned; when its step
        returns it resets the runner and leaves."""
        self._watchdog.halt(reason)

    def cancel_all(self, reason: str = SHUTTING_DOWN) -> int:
        """End every queued and running request now with Finished(CANCELLED, reason) (a
        shutdown's grace ran out); the worker drops their work within one step."""
        return self._requests.end_all(lambda h: ending(h, FinishReason.CANCELLED, reason))

    @property
    def running(self) -> bool:
        """Started and not stopped (the worker may be restarting: see `state`)."""
        return self._watchdog.phase is not EngineState.STOPPED

    @property
    def state(self) -> EngineState:
        phase = self._watchdog.phase
        if phase is EngineState.RUNNING and self._draining:
            return EngineState.DRAINING
        return phase

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished (queued or running)."""
        return self._requests.pending

    def health(self) -> EngineHealth:
        with self._lock:
            stopped = self._watchdog.phase is EngineState.STOPPED
            beat = self._watchdog.heartbeat
            return EngineHealth(
                state=self.state,
                heartbeat_age=None if stopped else beat.age(),
                busy=self.stats.busy,
                restarts=beat.restarts,
                failures=beat.failures,
                last_failure=beat.last_failure,
            )

    @property
    def queue_depth(self) -> int:
        return self._requests.depth

    @property
    def capacity(self) -> int:
        """How many requests may wait at once."""
        return self._requests.capacity

    # submission --------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; from asyncio the handle is async-iterable, else iterable."""
        self._check_open()
        return self._requests.put(request)

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Queue several requests back to back, all or none (the n choices of one API
        request): QueueFull when they do not all fit."""
        with self._requests.room_for(len(requests)):
            return [self.submit(r) for r in requests]

    def _check_open(self) -> None:
        state = self.state
        if state is EngineState.RUNNING:
            return
        if state is EngineState.STOPPED:
            raise EngineStopped("the engine is not running")
        if state is EngineState.DRAINING:
            raise EngineUnavailable("the server is shutting down", state)
        halted = self._watchdog.halted
        if halted is not None:
            raise EngineUnavailable(f"the engine stopped: {halted}", state)
        if state is EngineState.STALLED:
            message = (
                f"the engine stalled (no step for over {self.stall_seconds:g} s); it "
                "restarts when its stuck step returns"
            )
        else:
            last = self._watchdog.heartbeat.last_failure
            message = f"the engine failed ({last}) and is restarting"
        raise EngineUnavailable(message, state)
