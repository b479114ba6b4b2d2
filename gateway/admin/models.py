"""GET /v1/models, GET /v1/models/{id} and GET /health."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.core.served import ServedModel


def model_card(served: ServedModel) -> dict[str, object]:
    loaded = served.loaded
    return {
        "id": served.id,
        "object": "model",
        "created": served.created,
        "owned_by": "mlx-gateway",
        "context_length": served.context_length,
        "source": str(loaded.source),
        "dtype": loaded.dtype,
        "quantized": loaded.quantized,
        "capabilities": served.caps.card(),
    }


async def list_models(request: Request) -> JSONResponse:
    served: ServedModel = request.app.state.served
    return JSONResponse({"object": "list", "data": [model_card(served)]})


async def get_model(request: Request) -> JSONResponse:
    served: ServedModel = request.app.state.served
    served.check_model(str(request.path_params["model_id"]))
    return JSONResponse(model_card(served))


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
            "requests_total": stats.requests_total,
        }
    )
