"""Loading and unloading models, each on a thread of its own, never on the event loop:
a model loading (seconds to minutes) never stalls requests for another that is loaded.

Every caller waiting on one load shares its future; a load asked for while the model
unloads starts when the unload ends.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from gateway.core.errors import InternalError, Overloaded
from gateway.core.models.eviction import Eviction
from gateway.core.models.memory import release_memory, served_bytes
from gateway.core.models.served import ServedModel
from gateway.core.models.slots import SHUTTING_DOWN, Slot, Slots
from gateway.core.models.status import ModelFacts, ModelState, added_stats
from gateway.core.settings import DEFAULT_ENCODER_SHARE
from runtime.backend import release_thread_streams
from runtime.engine import Turns

log = logging.getLogger(__name__)


class Loader:
    """Loads a slot's model (making room under `budget` first) and unloads it."""

    def __init__(
        self, slots: Slots, budget: int, encoder_share: float = DEFAULT_ENCODER_SHARE
    ) -> None:
        self._slots = slots
        self.eviction = Eviction(slots, budget, self.unload)
        self._threads: set[threading.Thread] = set()
        # the models' engines share the cores: chat steps first, encoders between them
        # with `encoder_share` of the time; 1: no turns (they compute at once)
        if not 0.0 < encoder_share <= 1.0:
            raise ValueError(
                f"the encoder's share of the cores must be above 0 and at most 1, got "
                f"{encoder_share}"
            )
        self.turns = Turns(encoder_share) if encoder_share < 1.0 else None

    def load(self, slot: Slot) -> concurrent.futures.Future[ServedModel]:
        """A future of the loaded model; every caller waiting on one load shares it."""
        with self._slots.cond:
            if self._slots.closed or self._slots.draining:
                raise Overloaded(
                    f"{SHUTTING_DOWN[:1].upper()}{SHUTTING_DOWN[1:]}; retry shortly.",
                    code="shutting_down",
                    headers={"Retry-After": "2"},
                )
            if slot.state is ModelState.LOADED:
                assert slot.served is not None
                done: concurrent.futures.Future[ServedModel] = concurrent.futures.Future()
                done.set_result(slot.served)
                return done
            if slot.pending is None:
                slot.pending = concurrent.futures.Future()
                # a running future cannot be cancelled: a waiter that gives up (its
                # client left) must not cancel the load the others wait for
                slot.pending.set_running_or_notify_cancel()
                if slot.state is ModelState.UNLOADED:
                    slot.state = ModelState.LOADING
                    self._spawn(self._load, slot, f"mlx-load-{slot.spec.id}")
                # UNLOADING: the unload starts this load when it ends
            return slot.pending

    def join(self, timeout: float) -> None:
        """Wait for the loads and unloads under way (the caller set `slots.closed`)."""
        with self._slots.cond:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)

    def _spawn(self, target: Callable[[Slot], None], slot: Slot, name: str) -> None:
        """Start `target(slot)` on a thread of its own (called with the lock held)."""

        def run() -> None:
            try:
                target(slot)
            finally:
                release_thread_streams()  # a load evaluates weights on this thread
                with self._slots.cond:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._threads.add(thread)
        thread.start()

    def _load(self, slot: Slot) -> None:
        """On a loader thread: make room, build, start the engine, publish."""
        spec = slot.spec
        try:
            self.eviction.make_room(slot)
            started = time.perf_counter()
            log.info("loading %s", spec.id)
            served = spec.build()
            if self.turns is not None:
                served.engine.take_turns(self.turns)
            served.engine.start()
            served.engine.watch()  # fails and restarts a dead or stalled worker
        except BaseException as exc:
            self._load_failed(slot, exc)
            return
        measured = served_bytes(served)
        with self._slots.cond:
            closed, draining = self._slots.closed, self._slots.draining
        if closed:  # close() gave up waiting for this load
            served.engine.stop()
            self._load_failed(slot, Overloaded(f"{SHUTTING_DOWN}; retry shortly."))
            return
        if draining:
            served.engine.drain()
        self.adopt(slot, served, measured)
        self.eviction.shed(slot)
        log.info(
            "%s loaded in %.1f s (%.0f MB of weights and caches)",
            spec.id,
            time.perf_counter() - started,
            slot.size / 1e6,
        )

    def adopt(self, slot: Slot, served: ServedModel, measured: int | None = None) -> None:
        """Publish `served` (its engine started) as the slot's loaded model."""
        with self._slots.cond:
            future, slot.pending = slot.pending, None
            slot.served, slot.state, slot.reserved = served, ModelState.LOADED, True
            slot.facts = ModelFacts.of(served)
            slot.size = measured or slot.size
            slot.error = None
            slot.loads += 1
            slot.last_used = time.monotonic()
            self._slots.cond.notify_all()
        if future is not None:
            future.set_result(served)

    def _load_failed(self, slot: Slot, exc: BaseException) -> None:
        if isinstance(exc, Overloaded):
            error: Exception = exc
        else:
            error = InternalError(
                f"The model {slot.spec.id!r} failed to load: {type(exc).__name__}: {exc}",
                code="model_load_failed",
            )
            # the cause is usually the files' (truncated, damaged): one line; the
            # traceback is for --log-level debug
            log.error("loading %s failed: %s: %s", slot.spec.id, type(exc).__name__, exc)
            log.debug("loading %s failed", slot.spec.id, exc_info=exc)
        with self._slots.cond:
            future, slot.pending = slot.pending, None
            slot.state, slot.reserved = ModelState.UNLOADED, False
            slot.error = str(error)
            self._slots.cond.notify_all()
        if future is not None:
            future.set_exception(error)

    def unload(self, slot: Slot, reason: str) -> None:
        """Stop the engine (it releases the runner's arrays), drop every reference and
        give the memory back; the slot is UNLOADING and nobody else touches it."""
        cond = self._slots.cond
        served = slot.served
        if served is not None:
            served.engine.stop()
            stats = served.engine.stats
            log.info("unloaded %s (%s)", slot.spec.id, reason)
        with cond:
            if served is not None:
                slot.retired = added_stats(slot.retired, stats)
                slot.retired.busy, slot.retired.running, slot.retired.prefilling = False, 0, 0
            slot.served = None
        del served
        release_memory()
        with cond:
            slot.state, slot.reserved = ModelState.UNLOADED, False
            slot.unloads += 1
            if slot.pending is not None:
                if self._slots.closed:
                    self._load_failed(slot, Overloaded(f"{SHUTTING_DOWN}; retry shortly."))
                else:  # asked for while it was unloading
                    slot.state = ModelState.LOADING
                    self._spawn(self._load, slot, f"mlx-load-{slot.spec.id}")
            cond.notify_all()
