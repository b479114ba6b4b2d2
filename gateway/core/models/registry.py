"""The models a server is configured with: which are loaded, loading them on demand,
unloading idle ones after their keep-alive, and least recently used first when a new
one would not fit the memory budget.

Loads and unloads run on threads of their own, never on the event loop, so a model
loading (seconds to minutes) never stalls requests for another that is loaded. A request
holds a lease on its model from lookup to its last byte; a model with a lease is never
unloaded. One condition variable guards every slot's state; the event loop only takes
it for a few dictionary operations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from gateway.core.errors import InternalError, NotFound, Overloaded
from gateway.core.models.memory import default_memory_budget, release_memory, served_bytes
from gateway.core.models.served import ServedModel
from runtime.backend import release_thread_streams
from runtime.engine.engine import EngineState, EngineStats

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE_S = 1800.0
SHUTTING_DOWN = "the server is shutting down"


class ModelState(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(frozen=True)
class ModelSpec:
    """One configured model. `build` loads its weights and makes its engine (not
    started); it runs on a loader thread each time the model is loaded."""

    id: str
    build: Callable[[], ServedModel]
    aliases: frozenset[str] = frozenset()
    source: str = ""  # what its card shows before it is first loaded
    weight_bytes: int = 0  # the weights' estimate until a load measures them
    cache_bytes: int = 0  # the cache memory its runner gets (batch and prefix trie)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name this model answers to: its id, then the aliases."""
        return (self.id, *sorted(self.aliases - {self.id}))


@dataclass(frozen=True)
class ModelFacts:
    """What a model's card reports, kept from its last load while it is unloaded."""

    context_length: int
    capabilities: Mapping[str, Any]
    sampling_defaults: Mapping[str, float]
    source: str
    dtype: str
    quantized: bool

    @classmethod
    def of(cls, served: ServedModel) -> ModelFacts:
        loaded = served.loaded
        return cls(
            context_length=served.context_length,
            capabilities=served.caps.card(),
            sampling_defaults=dict(served.sampling_defaults),
            source=str(loaded.source),
            dtype=loaded.dtype,
            quantized=loaded.quantized,
        )


_COUNTERS = (
    "requests_total",
    "requests_failed",
    "requests_cancelled",
    "prompt_tokens_total",
    "completion_tokens_total",
    "decode_steps",
)


def _added(a: EngineStats, b: EngineStats) -> EngineStats:
    """`b`'s gauges with both counters summed: an engine's totals outlive its unload."""
    out = EngineStats(**{f.name: getattr(b, f.name) for f in fields(EngineStats)})
    for name in _COUNTERS:
        setattr(out, name, getattr(a, name) + getattr(b, name))
    return out


@dataclass
class _Slot:
    """A configured model's state (guarded by the registry's condition)."""

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


@dataclass(frozen=True)
class ModelStatus:
    """One model as /health, /v1/models and /metrics report it."""

    spec: ModelSpec
    state: ModelState
    served: ServedModel | None
    facts: ModelFacts | None
    size_bytes: int
    idle_seconds: float | None  # None while in use or not loaded
    loads: int
    unloads: int
    error: str | None
    stats: EngineStats  # the counters of every engine it had, the gauges of the live one
    queue_depth: int
    created: int

    @property
    def engine_state(self) -> EngineState | None:
        return None if self.served is None else self.served.engine.state

    def card(self) -> dict[str, Any]:
        return {
            "id": self.spec.id,
            "state": self.state.value,
            "loaded": self.state is ModelState.LOADED,
            "aliases": list(self.spec.names[1:]),
            "loads": self.loads,
            "memory_bytes": self.size_bytes,
            "idle_seconds": None if self.idle_seconds is None else round(self.idle_seconds, 3),
            "last_error": self.error,
        }


class Lease:
    """A request's hold on its model: while any is held, the model stays loaded."""

    def __init__(self, registry: ModelRegistry, slot: _Slot) -> None:
        self._registry = registry
        self._slot = slot
        self._held = True

    @property
    def spec(self) -> ModelSpec:
        return self._slot.spec

    def release(self) -> None:
        if self._held:
            self._held = False
            self._registry._release(self._slot)


class ModelRegistry:
    """The configured models; the first is the default (a request that names none)."""

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        *,
        keep_alive: float = DEFAULT_KEEP_ALIVE_S,
        memory_budget: int | None = None,
    ) -> None:
        if not specs:
            raise ValueError("configure at least one model")
        if keep_alive < 0:
            raise ValueError("keep_alive cannot be negative")
        self._slots = [_Slot(spec, size=spec.weight_bytes + spec.cache_bytes) for spec in specs]
        self._by_name: dict[str, _Slot] = {}
        for slot in self._slots:
            for name in slot.spec.names:
                other = self._by_name.setdefault(name, slot)
                if other is not slot:
                    raise ValueError(
                        f"the name {name!r} is given to both {other.spec.id!r} and "
                        f"{slot.spec.id!r}; each model name must be unique"
                    )
        self.keep_alive = keep_alive  # seconds idle before an unload; 0 = never
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self._cond = threading.Condition()
        self._closed = False
        self._draining = False
        self._threads: set[threading.Thread] = set()
        self._reaper: threading.Thread | None = None

    @classmethod
    def serving(cls, served: ServedModel, build: Callable[[], ServedModel]) -> ModelRegistry:
        """One model, already loaded, that never unloads (an app made from a loader)."""
        spec = ModelSpec(served.id, build, served.aliases, str(served.loaded.source))
        registry = cls([spec], keep_alive=0)
        served.engine.start()
        served.engine.watch()
        registry._adopt(registry._slots[0], served)
        return registry

    # -- names --------------------------------------------------------------------------
    @property
    def default(self) -> ModelSpec:
        return self._slots[0].spec

    @property
    def specs(self) -> tuple[ModelSpec, ...]:
        return tuple(slot.spec for slot in self._slots)

    def find(self, name: str | None) -> ModelSpec:
        """The model a request's `model` names (None: the default); 404 for a name no
        configured model answers to, listing the names that work."""
        if name is None:
            return self.default
        slot = self._by_name.get(name)
        if slot is None:
            raise self._not_found(name)
        return slot.spec

    def _not_found(self, name: str) -> NotFound:
        known = ", ".join(repr(n) for slot in self._slots for n in slot.spec.names)
        if len(self._slots) == 1:
            how = (
                f"restart it with --model-alias {shlex.quote(name)} (repeatable; or add it "
                "to the comma-separated MLX_GATEWAY_MODEL_ALIAS)"
            )
        else:
            how = "add it to a model's `aliases` in the --config file"
        return NotFound(
            f"The model {name!r} is not served here; this server answers to {known} "
            f"(GET /v1/models lists them). To answer to this name too, {how}.",
            param="model",
            code="model_not_found",
        )

    # -- use ----------------------------------------------------------------------------
    def lease(self, spec: ModelSpec) -> Lease:
        slot = self._slot(spec)
        with self._cond:
            slot.leases += 1
            slot.last_used = time.monotonic()
        return Lease(self, slot)

    def _release(self, slot: _Slot) -> None:
        with self._cond:
            slot.leases -= 1
            slot.last_used = time.monotonic()
            self._cond.notify_all()  # the reaper's deadline moved; a loader may fit now

    def loaded(self, spec: ModelSpec) -> ServedModel | None:
        """The model if it is loaded now (no waiting)."""
        slot = self._slot(spec)
        with self._cond:
            return slot.served if slot.state is ModelState.LOADED else None

    async def ready(self, spec: ModelSpec) -> ServedModel:
        """The model, loaded first when it is not (the caller waits, the loop does not)."""
        served = self.loaded(spec)
        if served is not None:
            return served
        return await asyncio.wrap_future(self.load(spec))

    def load(self, spec: ModelSpec) -> concurrent.futures.Future[ServedModel]:
        """A future of the loaded model; every caller waiting on one load shares it."""
        slot = self._slot(spec)
        with self._cond:
            if self._closed or self._draining:
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
                    self._spawn(self._load, slot, f"mlx-load-{spec.id}")
                # UNLOADING: the unload starts this load when it ends
            return slot.pending

    # -- lifecycle ----------------------------------------------------------------------
    async def open(self) -> None:
        """Load the default model (the server takes connections once it is ready) and
        start the keep-alive reaper."""
        await self.ready(self.default)
        with self._cond:
            if self.keep_alive > 0 and self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="mlx-model-reaper", daemon=True
                )
                self._reaper.start()

    def drain(self) -> None:
        """Refuse new loads and new generations; running ones go on."""
        with self._cond:
            self._draining = True
            engines = [s.served.engine for s in self._slots if s.served is not None]
        for engine in engines:
            engine.drain()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def pending(self) -> int:
        """Generations submitted and unfinished, over every loaded model."""
        return sum(engine.pending for engine in self._engines())

    def cancel_all(self, reason: str) -> int:
        return sum(engine.cancel_all(reason) for engine in self._engines())

    def close(self, timeout: float = 30.0) -> None:
        """Stop every engine and wait for loads under way (the app is shutting down)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            reaper, threads = self._reaper, list(self._threads)
        if reaper is not None:
            reaper.join(timeout)
        for thread in threads:
            thread.join(timeout)
        with self._cond:
            live = [s for s in self._slots if s.state is ModelState.LOADED]
            for slot in live:
                slot.state = ModelState.UNLOADING
        for slot in live:
            self._unload(slot, reason="shutdown")

    def _engines(self) -> list[Any]:
        with self._cond:
            return [s.served.engine for s in self._slots if s.served is not None]

    # -- status -------------------------------------------------------------------------
    def status(self) -> list[ModelStatus]:
        now = time.monotonic()
        with self._cond:
            return [self._status(slot, now) for slot in self._slots]

    def _status(self, slot: _Slot, now: float) -> ModelStatus:
        served = slot.served if slot.state is ModelState.LOADED else None
        engine = None if served is None else served.engine
        stats = slot.retired if engine is None else _added(slot.retired, engine.stats)
        idle = None
        if served is not None and slot.leases == 0:
            idle = max(0.0, now - slot.last_used)
        return ModelStatus(
            spec=slot.spec,
            state=slot.state,
            served=served,
            facts=slot.facts,
            size_bytes=slot.size,
            idle_seconds=idle,
            loads=slot.loads,
            unloads=slot.unloads,
            error=slot.error,
            stats=stats,
            queue_depth=0 if engine is None else engine.queue_depth,
            created=slot.created,
        )

    # -- loading ------------------------------------------------------------------------
    def _slot(self, spec: ModelSpec) -> _Slot:
        slot = self._by_name.get(spec.id)
        if slot is None or slot.spec is not spec:
            raise KeyError(f"{spec.id!r} is not a model of this registry")
        return slot

    def _spawn(self, target: Callable[[_Slot], None], slot: _Slot, name: str) -> None:
        """Start `target(slot)` on a thread of its own (called with the lock held)."""

        def run() -> None:
            try:
                target(slot)
            finally:
                release_thread_streams()  # a load evaluates weights on this thread
                with self._cond:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._threads.add(thread)
        thread.start()

    def _load(self, slot: _Slot) -> None:
        """On a loader thread: make room, build, start the engine, publish."""
        spec = slot.spec
        try:
            self._make_room(slot)
            started = time.perf_counter()
            log.info("loading %s", spec.id)
            served = spec.build()
            served.engine.start()
            served.engine.watch()  # fails and restarts a dead or stalled worker
        except BaseException as exc:
            self._load_failed(slot, exc)
            return
        measured = served_bytes(served)
        with self._cond:
            closed, draining = self._closed, self._draining
        if closed:  # close() gave up waiting for this load
            served.engine.stop()
            self._load_failed(slot, Overloaded(f"{SHUTTING_DOWN}; retry shortly."))
            return
        if draining:
            served.engine.drain()
        self._adopt(slot, served, measured)
        self._shed(slot)
        log.info(
            "%s loaded in %.1f s (%.0f MB of weights and caches)",
            spec.id,
            time.perf_counter() - started,
            slot.size / 1e6,
        )

    def _adopt(self, slot: _Slot, served: ServedModel, measured: int | None = None) -> None:
        with self._cond:
            future, slot.pending = slot.pending, None
            slot.served, slot.state, slot.reserved = served, ModelState.LOADED, True
            slot.facts = ModelFacts.of(served)
            slot.size = measured or slot.size
            slot.error = None
            slot.loads += 1
            slot.last_used = time.monotonic()
            self._cond.notify_all()
        if future is not None:
            future.set_result(served)

    def _load_failed(self, slot: _Slot, exc: BaseException) -> None:
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
        with self._cond:
            future, slot.pending = slot.pending, None
            slot.state, slot.reserved = ModelState.UNLOADED, False
            slot.error = str(error)
            self._cond.notify_all()
        if future is not None:
            future.set_exception(error)

    def _make_room(self, slot: _Slot) -> None:
        """Unload idle models, least recently used first, until `slot` fits the budget;
        with only busy models in the way, wait for one to go idle. A model bigger than
        the whole budget loads once nothing else is loaded."""
        waited = False
        with self._cond:
            while True:
                if self._closed:
                    raise Overloaded(f"{SHUTTING_DOWN}; retry shortly.", code="shutting_down")
                held = [s for s in self._slots if s is not slot and s.reserved]
                used = sum(s.size for s in held)
                if used + slot.size <= self.memory_budget or not held:
                    if used + slot.size > self.memory_budget:
                        log.warning(
                            "%s (%.0f MB) is larger than the memory budget (%.0f MB); "
                            "loading it anyway", slot.spec.id, slot.size / 1e6,
                            self.memory_budget / 1e6,
                        )  # fmt: skip
                    slot.reserved = True
                    return
                if self._evict_one(slot, held):
                    continue
                if not waited:
                    log.info(
                        "%s waits for memory: %s busy", slot.spec.id,
                        ", ".join(s.spec.id for s in held),
                    )  # fmt: skip
                    waited = True
                self._cond.wait(1.0)

    def _shed(self, slot: _Slot) -> None:
        """After a load measured `slot` bigger than its estimate (a quantized file
        dequantized on a CPU): unload idle models until the budget holds again."""
        with self._cond:
            while True:
                held = [s for s in self._slots if s.reserved]
                if sum(s.size for s in held) <= self.memory_budget:
                    return
                if not self._evict_one(slot, [s for s in held if s is not slot]):
                    log.warning(
                        "over the memory budget (%.0f MB): the other loaded models are busy",
                        self.memory_budget / 1e6,
                    )
                    return

    def _evict_one(self, slot: _Slot, held: list[_Slot]) -> bool:
        """Unload the least recently used idle model of `held` to make room for `slot`
        (called with the lock held; released during the unload). False: none is idle."""
        idle = [s for s in held if s.state is ModelState.LOADED and self._idle(s)]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        victim.state = ModelState.UNLOADING
        self._cond.release()
        try:
            self._unload(victim, reason=f"room for {slot.spec.id}")
        finally:
            self._cond.acquire()
        return True

    # -- unloading ----------------------------------------------------------------------
    @staticmethod
    def _idle(slot: _Slot) -> bool:
        served = slot.served
        return slot.leases == 0 and (served is None or served.engine.pending == 0)

    def _unload(self, slot: _Slot, *, reason: str) -> None:
        """Stop the engine (it releases the runner's arrays), drop every reference and
        give the memory back; the slot is UNLOADING and nobody else touches it."""
        served = slot.served
        if served is not None:
            served.engine.stop()
            stats = served.engine.stats
            log.info("unloaded %s (%s)", slot.spec.id, reason)
        with self._cond:
            if served is not None:
                slot.retired = _added(slot.retired, stats)
                slot.retired.busy, slot.retired.running, slot.retired.prefilling = False, 0, 0
            slot.served = None
        del served
        release_memory()
        with self._cond:
            slot.state, slot.reserved = ModelState.UNLOADED, False
            slot.unloads += 1
            if slot.pending is not None:
                if self._closed:
                    self._load_failed(slot, Overloaded(f"{SHUTTING_DOWN}; retry shortly."))
                else:  # asked for while it was unloading
                    slot.state = ModelState.LOADING
                    self._spawn(self._load, slot, f"mlx-load-{slot.spec.id}")
            self._cond.notify_all()

    def _reap(self) -> None:
        """Unload models idle for keep_alive seconds; sleep until the next could be."""
        with self._cond:
            while not self._closed:
                due, wait = self._due(time.monotonic())
                if not due:
                    self._cond.wait(wait)
                    continue
                for slot in due:
                    slot.state = ModelState.UNLOADING
                self._cond.release()
                try:
                    for slot in due:
                        self._unload(slot, reason=f"idle for {self.keep_alive:g} s")
                finally:
                    self._cond.acquire()

    def _due(self, now: float) -> tuple[list[_Slot], float | None]:
        """The models to unload now, and how long until the next one may be due."""
        due: list[_Slot] = []
        wait: float | None = None
        for slot in self._loaded_slots():
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

    def _loaded_slots(self) -> Iterator[_Slot]:
        return (s for s in self._slots if s.state is ModelState.LOADED)
