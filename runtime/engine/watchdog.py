"""The engine's watchdog: it starts the worker thread and keeps one serving.

If the worker dies (an exception escaped its loop), every queued and running request
ends with an `EngineFailure` and a fresh worker starts after a delay that doubles per
failure in a row. If it makes no step for `stall_seconds` while it has work, its
requests fail the same way and it is abandoned (a Python thread cannot be killed): a
fresh worker starts when its step returns. `halt` stops it for good. The engine's
docstring (runtime/engine/engine.py) tells the whole story.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from runtime import backend
from runtime.engine.request_queue import RequestQueue
from runtime.engine.types import BatchRunner, EngineState, EngineStats, Heartbeat, Runner
from runtime.engine.worker import Worker

log = logging.getLogger(__name__)

MAX_RESTART_DELAY_S = 60.0


class Watchdog:
    """The worker thread's lifecycle: `phase` (STOPPED, RUNNING, FAILED or STALLED),
    the current and the abandoned worker, restarts, and the heartbeat /health reads.

    `lock` is the engine's: the engine's own state changes and these go in one order."""

    def __init__(
        self,
        runner: Runner | BatchRunner,
        requests: RequestQueue,
        stats: EngineStats,
        lock: threading.RLock,
        *,
        stall_seconds: float,
        restart_delay: float,
    ) -> None:
        self._runner = runner
        self._requests = requests
        self._stats = stats
        self._lock = lock
        self.stall_seconds = stall_seconds  # no step for this long, with work: stalled
        self.restart_delay = restart_delay  # before the first restart; doubles per failure
        self.heartbeat = Heartbeat()
        self.phase = EngineState.STOPPED
        self.halted: str | None = None  # why the engine stopped for good (see halt)
        self._generation = 0  # bumped per worker: an abandoned one sees it changed
        self._thread: threading.Thread | None = None
        self._abandoned: threading.Thread | None = None
        self._restart_at = 0.0
        self._watcher: threading.Thread | None = None
        self._unwatch = threading.Event()

    # the engine's calls --------------------------------------------------------------
    def start(self) -> None:
        """Start the first worker (the caller holds the lock, the phase is STOPPED)."""
        self.phase = EngineState.RUNNING
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

    def stop(self, timeout: float) -> tuple[threading.Thread | None, threading.Thread | None]:
        """Stop watching and let go of the workers: (the current one, an abandoned one),
        for the engine to end."""
        with self._lock:
            thread, self._thread = self._thread, None
            abandoned, self._abandoned = self._abandoned, None
            watcher, self._watcher = self._watcher, None
            self.phase = EngineState.STOPPED
        self._unwatch.set()
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout)
        return thread, abandoned

    def halt(self, reason: str) -> None:
        """Fail every request now; no fresh worker will start (see Engine.halt)."""
        with self._lock:
            if self.phase is EngineState.STOPPED or self.halted is not None:
                return
            log.error("the engine stops for good: %s", reason)
            self.halted = reason
            self.phase = EngineState.FAILED
            self._restart_at = math.inf
            if self._thread is not None:
                self._abandoned, self._thread = self._thread, None
            self._generation += 1
            self.heartbeat.failed(reason)
            self._requests.fail_all(f"the engine stopped: {reason}")

    # watching ------------------------------------------------------------------------
    def _monitor(self, interval: float) -> None:
        while not self._unwatch.wait(interval):
            try:
                self.check()
            except Exception:  # the watchdog must outlive whatever it watches
                log.exception("engine watchdog check failed")

    def check(self) -> None:
        """One watchdog pass: restart a dead or returned worker, abandon a stalled one."""
        now = time.monotonic()
        with self._lock:
            phase, thread = self.phase, self._thread
            if phase is EngineState.STOPPED:
                return
            if self.halted is not None:
                return  # for good: nothing to restart
            if phase is EngineState.STALLED:
                if self._abandoned is None or not self._abandoned.is_alive():
                    self._abandoned = None
                    self._respawn()
                return
            if thread is not None and thread.is_alive():
                silent = now - self.heartbeat.at
                if (
                    phase is EngineState.RUNNING
                    and self._stats.busy
                    and silent > self.stall_seconds
                ):
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
        self.phase = EngineState.STALLED
        self._abandoned, self._thread = thread, None
        self._generation += 1
        self.heartbeat.failed(f"stalled: no step for {silent:.0f} s")
        self._requests.fail_all(
            f"the engine stalled (no step for {silent:.0f} s) and is restarting"
        )

    def _failed(self, error: str) -> None:
        """The current worker died: fail its requests; restart after a delay."""
        self.phase = EngineState.FAILED
        self.heartbeat.failed(error)
        streak = self.heartbeat.streak
        delay = min(self.restart_delay * 2 ** (streak - 1), MAX_RESTART_DELAY_S)
        self._restart_at = time.monotonic() + delay
        log.error("the engine's worker failed (%s); restarting it in %.1f s", error, delay)
        self._requests.fail_all(f"the engine's worker failed ({error}) and is restarting")

    def _respawn(self) -> None:
        self.phase = EngineState.RUNNING
        self.heartbeat.restarts += 1
        log.warning("starting a fresh engine worker (restart %d)", self.heartbeat.restarts)
        self._spawn(recover=True)

    # the worker thread ---------------------------------------------------------------
    def _spawn(self, *, recover: bool) -> None:
        self._generation += 1
        self.heartbeat.beat()
        self._stats.busy = False
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
        worker = Worker(
            self._runner,
            self._requests,
            self._stats,
            self.heartbeat,
            lambda: self._current(generation),
        )
        try:
            worker.run(recover)
        except BaseException as exc:  # the watchdog restarts the worker
            if not self._current(generation):  # abandoned (stalled, halted): reported then
                log.info("an abandoned engine worker ended: %s: %s", type(exc).__name__, exc)
                return
            log.exception("the engine's worker stopped")
            with self._lock:
                if self._current(generation) and self.phase is EngineState.RUNNING:
                    self._failed(f"{type(exc).__name__}: {exc}")
