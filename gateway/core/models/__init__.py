"""The served models' lifecycle: the registry (load on demand, keep-alive, eviction),
one loaded model (served), building one (build), a route's way to its model (use) and
memory accounting (memory).

The exports resolve on first use (PEP 562): the CLI imports EngineSettings before its
--help, and an eager package would load the registry, the runtime engine and every
route helper with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.core.models.build import (
        SAMPLING_FIELDS,
        EngineSettings,
        build_served,
        model_folder,
        sampling_defaults,
    )
    from gateway.core.models.memory import (
        cache_budget,
        default_memory_budget,
        weight_file_bytes,
    )
    from gateway.core.models.registry import ModelRegistry
    from gateway.core.models.served import ServedModel
    from gateway.core.models.slots import Lease
    from gateway.core.models.spec import ModelSpec
    from gateway.core.models.status import ModelFacts, ModelState, ModelStatus
    from gateway.core.models.use import registry_of, with_model

# each export's module, under this package
_HOMES = {
    "SAMPLING_FIELDS": "build",
    "EngineSettings": "build",
    "build_served": "build",
    "model_folder": "build",
    "sampling_defaults": "build",
    "cache_budget": "memory",
    "default_memory_budget": "memory",
    "weight_file_bytes": "memory",
    "ModelRegistry": "registry",
    "ServedModel": "served",
    "Lease": "slots",
    "ModelSpec": "spec",
    "ModelFacts": "status",
    "ModelState": "status",
    "ModelStatus": "status",
    "registry_of": "use",
    "with_model": "use",
}

__all__ = [
    "SAMPLING_FIELDS",
    "EngineSettings",
    "Lease",
    "ModelFacts",
    "ModelRegistry",
    "ModelSpec",
    "ModelState",
    "ModelStatus",
    "ServedModel",
    "build_served",
    "cache_budget",
    "default_memory_budget",
    "model_folder",
    "registry_of",
    "sampling_defaults",
    "weight_file_bytes",
    "with_model",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
