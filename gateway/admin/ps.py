"""GET /admin/ps: the models this server holds in memory now (what `mlx-gateway ps` shows
and what `mlx-gateway rm` checks before removing a model's files).

One entry per model that is loaded, loading or unloading (an unloaded one holds no
memory): its id and aliases, the files it was loaded from, the memory its weights and
caches were counted at, the seconds of keep-alive left (null while a request uses it, or
when models never unload), the requests running and queued, and its prefix cache's size
in memory. Needs the key like every API route.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.core.models import ModelFacts, ModelRegistry, ModelState, ModelStatus
from gateway.core.with_model import registry_of


def _prefix_cache(status: ModelStatus) -> dict[str, int] | None:
    """The prefix cache's snapshot bytes in memory and their bound; None without one."""
    runner = None if status.served is None else status.served.runner
    if runner is None:
        return None
    prefix = runner.prefix
    # two ints the engine's thread updates: read without its lock, as /metrics reads gauges
    return {"memory_bytes": int(prefix.paged_bytes), "budget_bytes": int(prefix.budget_bytes)}


def _keep_alive_left(status: ModelStatus, keep_alive: float) -> float | None:
    if keep_alive <= 0 or status.idle_seconds is None:
        return None  # never unloads, or in use now (the countdown starts when it is idle)
    return round(max(0.0, keep_alive - status.idle_seconds), 3)


def model_entry(status: ModelStatus, keep_alive: float) -> dict[str, Any]:
    served = status.served
    facts = ModelFacts.of(served) if served is not None else status.facts
    engine = None if served is None else served.engine
    pending = 0 if engine is None else engine.pending
    return {
        "id": status.spec.id,
        "aliases": list(status.spec.names[1:]),
        "state": status.state.value,
        "source": facts.source if facts is not None else status.spec.source,
        "memory_bytes": status.size_bytes,
        "context_length": None if facts is None else facts.context_length,
        "dtype": None if facts is None else facts.dtype,
        "quantized": None if facts is None else facts.quantized,
        "idle_seconds": None if status.idle_seconds is None else round(status.idle_seconds, 3),
        "keep_alive_left_seconds": _keep_alive_left(status, keep_alive),
        "requests_running": max(0, pending - status.queue_depth),
        "requests_queued": status.queue_depth,
        "prefix_cache": _prefix_cache(status),
    }


def ps_body(models: ModelRegistry) -> dict[str, Any]:
    keep_alive = models.keep_alive
    held = [s for s in models.status() if s.state is not ModelState.UNLOADED]
    return {
        "object": "list",
        "keep_alive_seconds": keep_alive,
        "memory_budget_bytes": models.memory_budget,
        "models": [model_entry(s, keep_alive) for s in held],
    }


async def ps(request: Request) -> JSONResponse:
    return JSONResponse(ps_body(registry_of(request)))


ROUTES = [
    Route("/admin/ps", ps, methods=["GET"]),
]
