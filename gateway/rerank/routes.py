"""POST /v1/rerank (and /rerank, /v2/rerank: the paths llama.cpp, vLLM, Cohere and Jina
clients call) on a cross-encoder model; any other model is a 400 naming what it serves."""

from __future__ import annotations

from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.core.encode import encode, encoder_for
from gateway.core.http import read_model
from gateway.core.models import ServedModel
from gateway.core.preparing import prepare_off_loop
from gateway.core.with_model import with_model
from gateway.rerank import adapt, emit
from gateway.rerank.wire import RerankRequest


async def rerank(request: Request) -> Response:
    req = await read_model(request, RerankRequest)
    return await with_model(request, req.model, partial(_rerank, request, req))


async def _rerank(request: Request, req: RerankRequest, served: ServedModel) -> Response:
    loaded = encoder_for(served, "rerank", request.url.path)
    plan = adapt.plan(req)
    inputs = await prepare_off_loop(request, partial(adapt.inputs, loaded, plan))
    result = await encode(request, served, inputs)
    scores = result.values[:, 0]
    return JSONResponse(emit.body(served.id, plan, scores, result.stats.prompt_tokens))


ROUTES = [Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")]
