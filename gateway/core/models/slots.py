"""The configured models' slots: which are loaded, loading or unloading, who holds a
lease on each, and the one condition variable that guards all of them.

Every other part of the registry (the loader, eviction, the keep-alive reaper) reads
and changes a slot only while holding `Slots.cond`; the event loop takes it for a few
dictionary operations only.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.core.models.served import ServedModel
from gateway.core.models.spec import ModelSpec
from gateway.core.models.status import ModelFacts, ModelState, ModelStatus, added_stats
from runtime.engine import EngineStats

if TYPE_CHECKING:
    from runtime.engine import Engine

SHUTTING_DOWN = "the server is shutting down"  # why a load is refused once `closed`


@dataclass
class Slot:
    """A configured model's state (guarded by `Slots.cond`)."""

    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    served: ServedModel | None = None
    pending: concurrent.futures.Future[ServedModel] | None = None  # the load under way
    reserved: bool = False  # a loader holds its share of the budget
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    size: int = 0
    facts: ModelFacts | None = None
    error: str | None = None  # the last load's failure
    loads: int = 0
    unloads: int = 0
    retired: EngineStats = field(default_factory=EngineStats)  # unloaded engines' totals
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def idle(self) -> bool:
        """No request holds it and its engine has nothing left to finish."""
        served = self.served
        return self.leases == 0 and (served is None or served.engine.pending == 0)

    def status(self, now: float) -> ModelStatus:
        served = self.served if self.state is ModelState.LOADED else None
        engine = None if served is None else served.engine
        stats = self.retired if engine is None else added_stats(self.retired, engine.stats)
        idle = None
        if served is not None and self.leases == 0:
            idle = max(0.0, now - self.last_used)
        return ModelStatus(
            spec=self.spec,
            state=self.state,
            served=served,
            facts=self.facts,
            size_bytes=self.size,
            idle_seconds=idle,
            loads=self.loads,
            unloads=self.unloads,
            error=self.error,
            stats=stats,
            queue_depth=0 if engine is None else engine.queue_depth,
            created=self.created,
        )


# unload a slot the caller marked UNLOADING, for the reason given (to the log)
Unload = Callable[[Slot, str], None]


class Lease:
    """A request's hold on its model: while any is held, the model stays loaded."""

    def __init__(self, slots: Slots, slot: Slot) -> None:
        self._slots = slots
        self._slot = slot
        self._held = True

    @property
    def spec(self) -> ModelSpec:
        return self._slot.spec

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots.release(self._slot)


class Slots:
    """The slots, in configured order (the first is the default model), each found by
    any of its names; `closed` and `draining` are the whole registry's, guarded too."""

    def __init__(self, specs: Sequence[ModelSpec]) -> None:
        if not specs:
            raise ValueError("configure at least one model")
        self.all = tuple(Slot(spec, size=spec.weight_bytes + spec.cache_bytes) for spec in specs)
        self._by_name: dict[str, Slot] = {}
        for slot in self.all:
            for name in slot.spec.names:
                other = self._by_name.setdefault(name, slot)
                if other is not slot:
                    raise ValueError(
                        f"the name {name!r} is given to both {other.spec.id!r} and "
                        f"{slot.spec.id!r}; each model name must be unique"
                    )
        self.cond = threading.Condition()
        self.closed = False  # shutting down: no load starts, the reaper stops
        self.draining = False  # refusing new loads and generations

    def named(self, name: str) -> Slot | None:
        return self._by_name.get(name)

    def of(self, spec: ModelSpec) -> Slot:
        slot = self._by_name.get(spec.id)
        if slot is None or slot.spec is not spec:
            raise KeyError(f"{spec.id!r} is not a model of this registry")
        return slot

    def lease(self, spec: ModelSpec) -> Lease:
        slot = self.of(spec)
        with self.cond:
            slot.leases += 1
            slot.last_used = time.monotonic()
        return Lease(self, slot)

    def release(self, slot: Slot) -> None:
        with self.cond:
            slot.leases -= 1
            slot.last_used = time.monotonic()
            self.cond.notify_all()  # the reaper's deadline moved; a loader may fit now

    def loaded(self, spec: ModelSpec) -> ServedModel | None:
        """The model if it is loaded now (no waiting)."""
        slot = self.of(spec)
        with self.cond:
            return slot.served if slot.state is ModelState.LOADED else None

    def loaded_slots(self) -> Iterator[Slot]:
        """The LOADED slots (the caller holds the lock)."""
        return (s for s in self.all if s.state is ModelState.LOADED)

    def engines(self) -> list[Engine]:
        with self.cond:
            return [s.served.engine for s in self.all if s.served is not None]

    def status(self) -> list[ModelStatus]:
        now = time.monotonic()
        with self.cond:
            return [slot.status(now) for slot in self.all]
