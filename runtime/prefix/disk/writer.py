"""The prefix cache's disk writer: the one background thread that touches its directory.

Jobs (write a file, delete one, touch one) run in the order they were queued, so a
deletion queued after a write always finds the file written. The queue is bounded in
bytes (the state the queued writes hold); `submit` says no when it is full, or waits
when asked to (`close` does). The thread starts with the first job and ends on `stop`.
Jobs must not call MLX: the engine thread owns it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from runtime import backend

log = logging.getLogger(__name__)


class Writer:
    """The one background thread that touches the directory: jobs run in order."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._cond = threading.Condition()
        self._jobs: deque[tuple[int, Callable[[], None]]] = deque()
        self._pending = 0  # bytes queued or being written
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, nbytes: int, job: Callable[[], None], *, block: bool) -> bool:
        """Queue `job` (holding `nbytes` of arrays); False when full and not `block`."""
        with self._cond:
            while nbytes and self._pending and self._pending + nbytes > self.limit_bytes:
                if not block:
                    return False
                self._cond.wait()
            self._jobs.append((nbytes, job))
            self._pending += nbytes
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="prefix-cache-writer", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        try:
            self._drain_jobs()
        finally:
            backend.release_thread_streams()

    def _drain_jobs(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and self._thread is threading.current_thread():
                    self._cond.wait()
                if not self._jobs:
                    return  # stopped, and nothing left to do
                nbytes, job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception:
                log.exception("prefix cache: a disk job failed")
            finally:
                with self._cond:
                    self._pending -= nbytes
                    self._busy = False
                    self._cond.notify_all()

    def flush(self) -> None:
        with self._cond:
            while self._jobs or self._busy:
                self._cond.wait()

    def stop(self) -> None:
        """Finish the queued jobs and end the thread (a later job starts a new one)."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join()
