"""The models a server is configured with: which are loaded, loading them on demand,
unloading idle ones after their keep-alive, and least recently used first when a new
one would not fit the memory budget.

The registry is the face routes and the CLI use; its parts are the slots (slots.py: each
model's state, under one condition variable), the loader (loader.py: loads and unloads
on threads of their own), eviction under the memory budget (eviction.py) and the
keep-alive reaper (reaper.py). A request holds a lease on its model from lookup to its
last byte; a model with a lease is never unloaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shlex
from collections.abc import Callable, Sequence

from gateway.core.errors import NotFound
from gateway.core.models.loader import Loader
from gateway.core.models.memory import default_memory_budget
from gateway.core.models.reaper import Reaper
from gateway.core.models.served import ServedModel
from gateway.core.models.slots import Lease, Slots
from gateway.core.models.spec import ModelSpec
from gateway.core.models.status import ModelState, ModelStatus
from gateway.core.settings import DEFAULT_ENCODER_SHARE

DEFAULT_KEEP_ALIVE_S = 1800.0


class ModelRegistry:
    """The configured models; the first is the default (a request that names none)."""

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        *,
        keep_alive: float = DEFAULT_KEEP_ALIVE_S,
        memory_budget: int | None = None,
        encoder_share: float = DEFAULT_ENCODER_SHARE,
    ) -> None:
        self._slots = Slots(specs)
        budget = default_memory_budget() if memory_budget is None else memory_budget
        self._loader = Loader(self._slots, budget, encoder_share)
        self._reaper = Reaper(self._slots, keep_alive, self._loader.unload)

    @classmethod
    def serving(cls, served: ServedModel, build: Callable[[], ServedModel]) -> ModelRegistry:
        """One model, already loaded, that never unloads (an app made from a loader)."""
        spec = ModelSpec(served.id, build, served.aliases, str(served.loaded.source))
        registry = cls([spec], keep_alive=0)
        served.engine.start()
        served.engine.watch()
        registry._loader.adopt(registry._slots.all[0], served)
        return registry

    @property
    def keep_alive(self) -> float:
        """Seconds idle before an unload; 0 = never."""
        return self._reaper.keep_alive

    @property
    def memory_budget(self) -> int:
        """What the loaded models' weights and caches may take together, in bytes."""
        return self._loader.eviction.budget

    # -- names --------------------------------------------------------------------------
    @property
    def default(self) -> ModelSpec:
        return self._slots.all[0].spec

    @property
    def specs(self) -> tuple[ModelSpec, ...]:
        return tuple(slot.spec for slot in self._slots.all)

    def find(self, name: str | None) -> ModelSpec:
        """The model a request's `model` names (None: the default); 404 for a name no
        configured model answers to, listing the names that work."""
        if name is None:
            return self.default
        slot = self._slots.named(name)
        if slot is None:
            raise self._not_found(name)
        return slot.spec

    def _not_found(self, name: str) -> NotFound:
        slots = self._slots.all
        known = ", ".join(repr(n) for slot in slots for n in slot.spec.names)
        if len(slots) == 1:
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
        return self._slots.lease(spec)

    def loaded(self, spec: ModelSpec) -> ServedModel | None:
        """The model if it is loaded now (no waiting)."""
        return self._slots.loaded(spec)

    async def ready(self, spec: ModelSpec) -> ServedModel:
        """The model, loaded first when it is not (the caller waits, the loop does not)."""
        served = self.loaded(spec)
        if served is not None:
            return served
        return await asyncio.wrap_future(self.load(spec))

    def load(self, spec: ModelSpec) -> concurrent.futures.Future[ServedModel]:
        """A future of the loaded model; every caller waiting on one load shares it."""
        return self._loader.load(self._slots.of(spec))

    # -- lifecycle ----------------------------------------------------------------------
    async def open(self) -> None:
        """Load the default model (the server takes connections once it is ready) and
        start the keep-alive reaper."""
        await self.ready(self.default)
        self._reaper.start()

    def drain(self) -> None:
        """Refuse new loads and new generations; running ones go on."""
        with self._slots.cond:
            self._slots.draining = True
            engines = self._slots.engines()
        for engine in engines:
            engine.drain()

    @property
    def draining(self) -> bool:
        return self._slots.draining

    @property
    def pending(self) -> int:
        """Generations submitted and unfinished, over every loaded model."""
        return sum(engine.pending for engine in self._slots.engines())

    def cancel_all(self, reason: str) -> int:
        return sum(engine.cancel_all(reason) for engine in self._slots.engines())

    def close(self, timeout: float = 30.0) -> None:
        """Stop every engine and wait for loads under way (the app is shutting down)."""
        slots = self._slots
        with slots.cond:
            slots.closed = True
            slots.cond.notify_all()
        self._reaper.join(timeout)
        self._loader.join(timeout)
        with slots.cond:
            live = list(slots.loaded_slots())
            for slot in live:
                slot.state = ModelState.UNLOADING
        for slot in live:
            self._loader.unload(slot, "shutdown")

    # -- status -------------------------------------------------------------------------
    def status(self) -> list[ModelStatus]:
        return self._slots.status()
