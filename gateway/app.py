"""The Starlette app factory: routes, error handlers, and a lifespan that owns the engine."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import APIError, InternalError
from gateway.routes.chat import chat_completions
from gateway.routes.debug import prefix_cache
from gateway.routes.models import health, list_models
from gateway.served import ServedModel

log = logging.getLogger(__name__)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.openai_body(), status_code=err.status, headers=err.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if exc.status >= 500:
        log.error("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = APIError(str(exc.detail), code=None)
    err.status = exc.status_code
    err.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    if exc.status_code == 404:
        err.message = f"Unknown path {request.url.path}"
    elif exc.status_code == 405:
        err.message = f"Method {request.method} is not allowed on {request.url.path}"
    return _error_response(err)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error_response(InternalError(f"internal error: {type(exc).__name__}: {exc}"))


def create_app(load: Callable[[], ServedModel]) -> Starlette:
    """`load` builds the served model (loads weights, makes its engine). It runs in
    the lifespan, so the server accepts connections once the model is ready."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        served = load()
        served.engine.start()
        app.state.served = served
        log.info("serving %s (context %d)", served.id, served.context_length)
        try:
            yield
        finally:
            served.engine.stop()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/debug/prefix-cache", prefix_cache, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
