"""GET /v1/models and GET /v1/models/{id}.

GET /v1/models lists every configured model, loaded or not (`loaded` and `state` say
which), each followed by one card per alias.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.core.generation import output_bound, output_limit
from gateway.core.http import server_settings
from gateway.core.models import ModelFacts, ModelState, ModelStatus
from gateway.core.settings import ServerSettings
from gateway.core.with_model import registry_of


def model_card(
    status: ModelStatus, settings: ServerSettings, name: str | None = None
) -> dict[str, object]:
    """The model's card under `name` (its id, or one of its aliases). An unloaded model
    shows what its last load found; one never loaded, only its source."""
    spec = status.spec
    facts = ModelFacts.of(status.served) if status.served is not None else status.facts
    card: dict[str, object] = {
        "id": name or spec.id,
        "object": "model",
        "created": status.created,
        "owned_by": "mlx-gateway",
    }
    if facts is None:
        card["source"] = spec.source
    else:
        card.update(
            {
                "context_length": facts.context_length,
                # what a request that sets no limit may generate, and what any request may
                "max_tokens_default": output_bound(facts, settings),
                "max_output_tokens": output_limit(facts, settings),
                "sampling_defaults": dict(facts.sampling_defaults),
                "source": facts.source,
                "dtype": facts.dtype,
                "quantized": facts.quantized,
                "capabilities": dict(facts.capabilities),
            }
        )
    task = facts.capabilities.get("task") if facts is not None else spec.task
    if task is not None:
        card["task"] = task  # "generate", "embed" or "rerank"
    card["aliases"] = list(spec.names[1:])
    card["loaded"] = status.state is ModelState.LOADED
    card["state"] = status.state.value
    if name is not None and name != spec.id:
        card["alias_of"] = spec.id
    return card


async def list_models(request: Request) -> JSONResponse:
    """Each model, then one entry per alias: a client that checks its configured name
    against this list (or picks from it) finds every name the server answers to."""
    settings = server_settings(request)
    data = [
        model_card(status, settings, name)
        for status in registry_of(request).status()
        for name in status.spec.names
    ]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> JSONResponse:
    models = registry_of(request)
    name = str(request.path_params["model_id"])
    spec = models.find(name)
    status = next(s for s in models.status() if s.spec is spec)
    return JSONResponse(model_card(status, server_settings(request), name))


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
]
