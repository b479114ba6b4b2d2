"""What the engine's one MLX thread does: take requests from the queue whenever the
`BatchRunner`'s running batch has room and step them together, or serve them one at a
time with a plain `Runner`; end each request; beat the heartbeat at every step,
admission and idle poll, so the watchdog (runtime/engine/watchdog.py) sees it live.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Iterable
from typing import cast

from runtime.batch import RequestHandle
from runtime.engine.request_queue import SHUTTING_DOWN, RequestQueue, ending, failure
from runtime.engine.types import BatchRunner, EngineStats, Heartbeat, Runner
from runtime.types import Finished, FinishReason

log = logging.getLogger(__name__)

IDLE_POLL_S = 1.0  # an idle worker wakes this often, so its heartbeat stays fresh


def is_batch_runner(runner: object) -> bool:
    return all(hasattr(runner, name) for name in ("admit", "step", "has_room", "abort"))


class Worker:
    """One worker thread's loop. `current()` turns false when the watchdog abandoned this
    worker (it stalled, or the engine halted): it then resets the runner and leaves."""

    def __init__(
        self,
        runner: Runner | BatchRunner,
        requests: RequestQueue,
        stats: EngineStats,
        heartbeat: Heartbeat,
        current: Callable[[], bool],
    ) -> None:
        self._runner = runner
        self._requests = requests
        self._stats = stats
        self._heartbeat = heartbeat
        self._current = current

    def run(self, recover: bool) -> None:
        """Serve until stop() asks the worker to leave or it is abandoned; `recover`: a
        fresh worker after a failure, which first resets the runner."""
        runner = self._runner
        if not is_batch_runner(runner):
            self._serve_each()
            return
        batch = cast(BatchRunner, runner)
        if recover:
            self._reset(batch)
        self._serve_batched(batch)

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
            self._requests.finish(handle, failure(handle, "the engine restarted", finished.stats))
        close = getattr(runner, "close", None)
        if close is not None:
            close()

    # one request at a time -------------------------------------------------------
    def _serve_each(self) -> None:
        beat = self._heartbeat.beat
        while True:
            try:
                handle = self._requests.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                beat()
                continue
            if handle is None:
                return
            beat()
            self._serve(handle)
            beat()
            if not self._current():
                return  # abandoned mid-request: the watchdog starts a fresh worker

    def _serve(self, handle: RequestHandle) -> None:
        stats = self._stats
        stats.requests_total += 1
        if handle.cancelled:
            self._requests.finish(handle, ending(handle, FinishReason.CANCELLED))
            return
        stats.busy = True
        try:
            done = cast(Runner, self._runner).run(handle)
        except Exception as exc:  # one request's failure must never kill the worker
            log.exception("request failed")
            done = ending(handle, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            stats.busy = False
        self._complete(handle, done)

    # a running batch -------------------------------------------------------------
    def _serve_batched(self, runner: BatchRunner) -> None:
        stats = self._stats
        while True:
            if not self._current():
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
                self._heartbeat.beat()
                if not self._current():
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
        beat = self._heartbeat.beat
        while runner.idle or runner.has_room():
            try:
                if runner.idle:
                    handle = self._requests.get(timeout=IDLE_POLL_S)
                else:
                    handle = self._requests.get_nowait()
            except queue.Empty:
                beat()
                if runner.idle:
                    tick = getattr(runner, "tick", None)
                    if tick is None:
                        continue
                    tick()
                    return True  # back to the loop, which sees if this worker was abandoned
                return True
            if handle is None:
                return False
            beat()
            self._admit(runner, handle)
            beat()
        return True

    def _admit(self, runner: BatchRunner, handle: RequestHandle) -> None:
        self._stats.requests_total += 1
        if handle.cancelled:
            self._requests.finish(handle, ending(handle, FinishReason.CANCELLED))
            return
        try:
            runner.admit(handle)
        except Exception as exc:  # this request cannot run; the others go on
            log.info("request refused: %s", exc)
            self._complete(
                handle, ending(handle, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
            )

    def _complete(self, handle: RequestHandle, done: Finished) -> None:
        if done.reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._heartbeat.worked()
        self._requests.finish(handle, done)
