"""GET /v1/models, GET /v1/models/{id} and GET /health."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.core.generation import output_bound, output_limit
from gateway.core.http import server_settings
from gateway.core.served import ServedModel
from gateway.core.settings import ServerSettings


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


async def health(request: Request) -> JSONResponse:
    served: ServedModel | None = getattr(request.app.state, "served", None)
    if served is None or not served.engine.running:
        return JSONResponse(
            {"status": "starting", "model_loaded": False},
            status_code=503,
            headers={"Retry-After": "5"},
        )
    stats = served.engine.stats
    return JSONResponse(
        {
            "status": "ok",
            "model": served.id,
            "model_loaded": True,
            "context_length": served.context_length,
            "busy": stats.busy,
            "queue_depth": served.engine.queue_depth,
            "running": stats.running,
            "prefilling": stats.prefilling,
            "decode_step_seconds": round(stats.decode_step_seconds, 6),
            "requests_total": stats.requests_total,
        }
    )
