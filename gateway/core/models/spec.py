"""One configured model: the names it answers to, how to build it, and what it is
expected to take from the memory budget before its first load measures it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.models.served import ServedModel


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
    # what it serves, known from its files before a load: "generate", "embed" or
    # "rerank" (/v1/models cards show it, so a client picks an embedding model unloaded)
    task: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every name this model answers to: its id, then the aliases."""
        return (self.id, *sorted(self.aliases - {self.id}))
