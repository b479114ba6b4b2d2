"""What the registry reports about a model (/health, /v1/models, /metrics): its state,
the facts of its last load, and its engines' counters summed over every load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

from gateway.core.models.served import ServedModel
from gateway.core.models.spec import ModelSpec
from runtime.engine import EngineStats

if TYPE_CHECKING:
    from runtime.engine import EngineState


class ModelState(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


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


def added_stats(a: EngineStats, b: EngineStats) -> EngineStats:
    """`b`'s gauges with both counters summed: an engine's totals outlive its unload."""
    out = EngineStats(**{f.name: getattr(b, f.name) for f in fields(EngineStats)})
    for name in _COUNTERS:
        setattr(out, name, getattr(a, name) + getattr(b, name))
    return out


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
