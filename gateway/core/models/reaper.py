"""The keep-alive reaper: a thread that unloads models idle for `keep_alive` seconds,
sleeping until the next one could be due (a lease's release wakes it)."""

from __future__ import annotations

import threading
import time

from gateway.core.models.slots import Slot, Slots, Unload
from gateway.core.models.status import ModelState


class Reaper:
    """Unloads idle models after `keep_alive` seconds (0: never; no thread starts)."""

    def __init__(self, slots: Slots, keep_alive: float, unload: Unload) -> None:
        if keep_alive < 0:
            raise ValueError("keep_alive cannot be negative")
        self._slots = slots
        self.keep_alive = keep_alive
        self._unload = unload
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._slots.cond:
            if self.keep_alive > 0 and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="mlx-model-reaper", daemon=True
                )
                self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (the caller set `slots.closed` and notified)."""
        with self._slots.cond:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        slots = self._slots
        with slots.cond:
            while not slots.closed:
                due, wait = self.due(time.monotonic())
                if not due:
                    slots.cond.wait(wait)
                    continue
                for slot in due:
                    slot.state = ModelState.UNLOADING
                slots.cond.release()
                try:
                    for slot in due:
                        self._unload(slot, f"idle for {self.keep_alive:g} s")
                finally:
                    slots.cond.acquire()

    def due(self, now: float) -> tuple[list[Slot], float | None]:
        """The models to unload now, and how long until the next one may be due (called
        with the lock held)."""
        due: list[Slot] = []
        wait: float | None = None
        for slot in self._slots.loaded_slots():
            if slot.leases:
                continue
            if slot.served is not None and slot.served.engine.pending:
                slot.last_used = now  # finishing a generation its client left: busy
            left = slot.last_used + self.keep_alive - now
            if left <= 0:
                due.append(slot)
            else:
                wait = left if wait is None else min(wait, left)
        return due, wait
