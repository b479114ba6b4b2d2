"""GET /v1/models, GET /v1/models/{id}, and the health routes.

GET /health reports the server's `state`: `loading` (no model yet), `ready` (model
loaded, engine stepping), `draining` (shutting down: new requests get 503),
`engine_failed` (the engine's worker died; it restarts shortly), `stalled` (the worker
made no step within --engine-stall-seconds; a fresh one starts when it returns) or
`stopped`; 200 only when ready. GET /health/live (200 while the process answers) and
GET /health/ready (200 or 503) are the pair an orchestrator probes.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.core.generation import output_bound, output_limit
from gateway.core.http import server_settings
from gateway.core.served import ServedModel
from gateway.core.settings import ServerSettings
from runtime.engine import EngineState


def model_card(
    served: ServedModel, settings: ServerSettings, name: str | None = None
) -> dict[str, object]:
    """The model's card under `name` (its id, or one of its aliases)."""
    loaded = served.loaded
    card: dict[str, object] = {
        "id": name or served.id,
        "object": "model",
        "created": served.created,
        "owned_by": "mlx-gateway",
        "context_length": served.context_length,
        # what a request that sets no limit may generate, and what any request may
        "max_tokens_default": output_bound(served, settings),
        "max_output_tokens": output_limit(served, settings),
        "sampling_defaults": dict(served.sampling_defaults),
        "source": str(loaded.source),
        "dtype": loaded.dtype,
        "quantized": loaded.quantized,
        "capabilities": served.caps.card(),
        "aliases": list(served.names[1:]),
    }
    if name is not None and name != served.id:
        card["alias_of"] = served.id
    return card


async def list_models(request: Request) -> JSONResponse:
    """The model first, then one entry per alias: a client that checks its configured
    name against this list (or picks from it) finds every name the server answers to."""
    served: ServedModel = request.app.state.served
    settings = server_settings(request)
    data = [model_card(served, settings, name) for name in served.names]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> JSONResponse:
    served: ServedModel = request.app.state.served
    name = str(request.path_params["model_id"])
    served.check_model(name)
    return JSONResponse(model_card(served, server_settings(request), name))


_STATES = {
    EngineState.RUNNING: "ready",
    EngineState.DRAINING: "draining",
    EngineState.FAILED: "engine_failed",
    EngineState.STALLED: "stalled",
    EngineState.STOPPED: "stopped",
}
_NOT_READY = {"Retry-After": "5"}


def _state(request: Request) -> tuple[ServedModel | None, str]:
    served: ServedModel | None = getattr(request.app.state, "served", None)
    if served is None:
        return None, "loading"
    return served, _STATES[served.engine.state]


async def health(request: Request) -> JSONResponse:
    served, state = _state(request)
    if served is None:
        body = {"status": "starting", "state": state, "live": True, "ready": False}
        return JSONResponse({**body, "model_loaded": False}, status_code=503, headers=_NOT_READY)
    engine = served.engine
    stats, watch = engine.stats, engine.health()
    ready = state == "ready"
    age = watch.heartbeat_age
    return JSONResponse(
        {
            "status": "ok" if ready else state,
            "state": state,
            "live": True,
            "ready": ready,
            "model": served.id,
            "model_loaded": True,
            "context_length": served.context_length,
            "busy": stats.busy,
            "queue_depth": engine.queue_depth,
            "running": stats.running,
            "prefilling": stats.prefilling,
            "decode_step_seconds": round(stats.decode_step_seconds, 6),
            "requests_total": stats.requests_total,
            # seconds since the engine's worker last stepped, admitted or polled its queue
            "heartbeat_age_seconds": None if age is None else round(age, 3),
            "engine_restarts": watch.restarts,
            "engine_failures": watch.failures,
            "last_engine_failure": watch.last_failure,
        },
        status_code=200 if ready else 503,
        headers=None if ready else _NOT_READY,
    )


async def health_live(request: Request) -> JSONResponse:
    """The process is up and answering (a restart would not help a loading model)."""
    _, state = _state(request)
    return JSONResponse({"live": True, "state": state})


async def health_ready(request: Request) -> JSONResponse:
    """Whether to send this server requests now."""
    _, state = _state(request)
    ready = state == "ready"
    return JSONResponse(
        {"ready": ready, "state": state},
        status_code=200 if ready else 503,
        headers=None if ready else _NOT_READY,
    )
