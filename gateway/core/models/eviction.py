"""Keeping the loaded models inside the memory budget: before a load, unload idle ones,
least recently used first, until the new one fits (or wait for a busy one to go idle);
after a load that measured bigger than its estimate, unload idle ones until the budget
holds again."""

from __future__ import annotations

import logging

from gateway.core.errors import Overloaded
from gateway.core.models.slots import SHUTTING_DOWN, Slot, Slots, Unload
from gateway.core.models.status import ModelState

log = logging.getLogger(__name__)


class Eviction:
    """Makes room for a slot under `budget` bytes, unloading with `unload`."""

    def __init__(self, slots: Slots, budget: int, unload: Unload) -> None:
        self._slots = slots
        self.budget = budget
        self._unload = unload

    def make_room(self, slot: Slot) -> None:
        """Unload idle models, least recently used first, until `slot` fits the budget;
        with only busy models in the way, wait for one to go idle. A model bigger than
        the whole budget loads once nothing else is loaded."""
        slots, waited = self._slots, False
        with slots.cond:
            while True:
                if slots.closed:
                    raise Overloaded(f"{SHUTTING_DOWN}; retry shortly.", code="shutting_down")
                held = [s for s in slots.all if s is not slot and s.reserved]
                used = sum(s.size for s in held)
                if used + slot.size <= self.budget or not held:
                    if used + slot.size > self.budget:
                        log.warning(
                            "%s (%.0f MB) is larger than the memory budget (%.0f MB); "
                            "loading it anyway", slot.spec.id, slot.size / 1e6,
                            self.budget / 1e6,
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
                slots.cond.wait(1.0)

    def shed(self, slot: Slot) -> None:
        """After a load measured `slot` bigger than its estimate (a quantized file
        dequantized on a CPU): unload idle models until the budget holds again."""
        with self._slots.cond:
            while True:
                held = [s for s in self._slots.all if s.reserved]
                if sum(s.size for s in held) <= self.budget:
                    return
                if not self._evict_one(slot, [s for s in held if s is not slot]):
                    log.warning(
                        "over the memory budget (%.0f MB): the other loaded models are busy",
                        self.budget / 1e6,
                    )
                    return

    def _evict_one(self, slot: Slot, held: list[Slot]) -> bool:
        """Unload the least recently used idle model of `held` to make room for `slot`
        (called with the lock held; released during the unload). False: none is idle."""
        idle = [s for s in held if s.state is ModelState.LOADED and s.idle]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        victim.state = ModelState.UNLOADING
        cond = self._slots.cond
        cond.release()
        try:
            self._unload(victim, f"room for {slot.spec.id}")
        finally:
            cond.acquire()
        return True
