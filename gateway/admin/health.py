"""GET /health, /health/live and /health/ready.

GET /health reports the server's `state` from its default model: `loading` (starting up),
`ready` (loaded and stepping, or unloaded after its keep-alive: the next request loads
it), `draining` (shutting down: new requests get 503), `engine_failed` (the engine's
worker died; it restarts shortly), `stalled` (the worker made no step within
--engine-stall-seconds; a fresh one starts when it returns) or `stopped`; 200 only when
ready. `models` gives each model's state (loaded, loading, unloading, unloaded).
GET /health/live (200 while the process answers) and GET /health/ready (200 or 503) are
the pair an orchestrator probes.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.core.models import ModelFacts, ModelRegistry, ModelStatus
from runtime.engine import EngineState

_STATES = {
    EngineState.RUNNING: "ready",
    EngineState.DRAINING: "draining",
    EngineState.FAILED: "engine_failed",
    EngineState.STALLED: "stalled",
    EngineState.STOPPED: "stopped",
}
_NOT_READY = {"Retry-After": "5"}


def _state(request: Request) -> tuple[ModelRegistry | None, ModelStatus | None, str]:
    """The server's state, from its default model."""
    models = getattr(request.app.state, "models", None)
    if not isinstance(models, ModelRegistry):
        return None, None, "loading"
    default = models.status()[0]
    if models.draining:
        return models, default, "draining"
    if default.served is None:
        return models, default, "ready"  # unloaded after its keep-alive: loads on demand
    return models, default, _STATES[default.served.engine.state]


def _models(models: ModelRegistry) -> list[dict[str, Any]]:
    out = []
    for status in models.status():
        engine = status.engine_state
        out.append({**status.card(), "engine": None if engine is None else _STATES[engine]})
    return out


def _engine_fields(status: ModelStatus) -> dict[str, Any]:
    stats = status.stats
    fields: dict[str, Any] = {
        "busy": stats.busy,
        "queue_depth": status.queue_depth,
        "running": stats.running,
        "prefilling": stats.prefilling,
        "decode_step_seconds": round(stats.decode_step_seconds, 6),
        "requests_total": stats.requests_total,
    }
    watch = None if status.served is None else status.served.engine.health()
    age = None if watch is None else watch.heartbeat_age
    # seconds since the engine's worker last stepped, admitted or polled its queue
    fields["heartbeat_age_seconds"] = None if age is None else round(age, 3)
    fields["engine_restarts"] = 0 if watch is None else watch.restarts
    fields["engine_failures"] = 0 if watch is None else watch.failures
    fields["last_engine_failure"] = None if watch is None else watch.last_failure
    return fields


async def health(request: Request) -> JSONResponse:
    models, default, state = _state(request)
    if models is None or default is None:
        body = {"status": "starting", "state": state, "live": True, "ready": False}
        return JSONResponse({**body, "model_loaded": False}, status_code=503, headers=_NOT_READY)
    ready = state == "ready"
    facts = ModelFacts.of(default.served) if default.served is not None else default.facts
    return JSONResponse(
        {
            "status": "ok" if ready else state,
            "state": state,
            "live": True,
            "ready": ready,
            "model": default.spec.id,
            "model_loaded": default.served is not None,
            "context_length": None if facts is None else facts.context_length,
            **_engine_fields(default),
            "models": _models(models),
            "keep_alive_seconds": models.keep_alive,
            "memory_budget_bytes": models.memory_budget,
        },
        status_code=200 if ready else 503,
        headers=None if ready else _NOT_READY,
    )


async def health_live(request: Request) -> JSONResponse:
    """The process is up and answering (a restart would not help a loading model)."""
    _, _, state = _state(request)
    return JSONResponse({"live": True, "state": state})


async def health_ready(request: Request) -> JSONResponse:
    """Whether to send this server requests now."""
    _, _, state = _state(request)
    ready = state == "ready"
    return JSONResponse(
        {"ready": ready, "state": state},
        status_code=200 if ready else 503,
        headers=None if ready else _NOT_READY,
    )


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/health/live", health_live, methods=["GET"]),
    Route("/health/ready", health_ready, methods=["GET"]),
]
