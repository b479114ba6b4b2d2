"""The Starlette app factory: routes, error handlers, and a lifespan that owns the engine."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from anyio import to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import admin, anthropic, openai, rerank, ui
from gateway.admin import MetricsMiddleware
from gateway.core.auth import ApiKeyMiddleware
from gateway.core.errors import APIError, internal_error
from gateway.core.exposure import ExposureMiddleware
from gateway.core.metrics import Metrics
from gateway.core.models import ModelRegistry, ServedModel
from gateway.core.preparing import Preparing
from gateway.core.settings import ServerSettings

log = logging.getLogger(__name__)

# worker threads kept beyond --max-preparing's (the model loader, the debug view)
SPARE_THREADS = 8


def _error_response(err: APIError, path: str) -> JSONResponse:
    return JSONResponse(err.body_for(path), status_code=err.status, headers=err.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if exc.status >= 500:
        # a 503 (draining, restarting) is expected and retried; other 5xx are bugs
        level = logging.WARNING if exc.status == 503 else logging.ERROR
        log.log(level, "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
    return _error_response(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = APIError(str(exc.detail), code=None)
    err.status = exc.status_code
    err.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    if exc.status_code == 404:
        err.message = f"Unknown path {request.url.path}"
    elif exc.status_code == 405:
        err.message = f"Method {request.method} is not allowed on {request.url.path}"
    return _error_response(err, request.url.path)


async def _client_gone(request: Request, exc: Exception) -> Response:
    # the client left while sending its body: nobody will read an answer
    log.info("%s %s: client disconnected mid-request", request.method, request.url.path)
    return Response(status_code=400)


async def _unexpected(request: Request, exc: Exception) -> Response:
    # the exception's text stays in the log: the client gets the request id to quote
    err = internal_error(log, f"unhandled error on {request.method} {request.url.path}", exc=exc)
    return _error_response(err, request.url.path)


def _middleware(settings: ServerSettings, metrics: Metrics) -> list[Middleware]:
    # outermost first: CORS answers preflights and decorates every answer (401s too),
    # metrics count every request, the Host, body type and local-only pages are checked
    # (gateway/core/exposure.py), then the key
    stack = []
    if settings.cors_origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.cors_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["*"],
                expose_headers=["Retry-After"],
            )
        )
    stack.append(Middleware(MetricsMiddleware, metrics=metrics))
    stack.append(Middleware(ExposureMiddleware, settings=settings))
    if settings.api_key is not None:
        stack.append(Middleware(ApiKeyMiddleware, api_key=settings.api_key))
    return stack


def _routes() -> list[Route]:
    # each dialect exports its routes; the server's own endpoints come last. The page
    # comes first: it takes GET / from browsers only (gateway/ui/routes.py)
    return [*ui.ROUTES, *openai.ROUTES, *anthropic.ROUTES, *rerank.ROUTES, *admin.ROUTES]


def _one(load: Callable[[], ServedModel]) -> ModelRegistry:
    """The registry of one model built by `load` (a local here would keep the model
    alive past an unload)."""
    return ModelRegistry.serving(load(), load)


def create_app(
    models: ModelRegistry | Callable[[], ServedModel], settings: ServerSettings | None = None
) -> Starlette:
    """`models` are the configured models (the default one loads in the lifespan, the
    others on demand), or a function that builds the one model to serve (it never
    unloads). Either way the server accepts connections once the default model is ready."""
    settings = settings or ServerSettings()
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        registry = models if isinstance(models, ModelRegistry) else _one(models)
        # worker threads for every request in preparation, and spare ones for the model
        # loader, the debug view and the other blocking calls
        limiter = to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, settings.max_preparing + SPARE_THREADS)
        try:
            await registry.open()
            app.state.models = registry
            log.info("serving %s", ", ".join(spec.id for spec in registry.specs))
            yield
        finally:
            await to_thread.run_sync(registry.close)

    app = Starlette(
        routes=_routes(),
        middleware=_middleware(settings, metrics),
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            ClientDisconnect: _client_gone,
            Exception: _unexpected,
        },
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.preparing = Preparing(settings.max_preparing, settings.retry_after_seconds)
    return app
