"""GET /debug/prefix-cache: the prefix trie's counters, its nodes, the live pins and the
last requests' cache reports (what each reused, and why not more). `?model=NAME` picks
a model other than the default; a model that is not loaded has no cache to show.
GET /admin/state (gateway/admin/state.py) holds the same counters and pins, with the
trie as a tree and the requests' paths through it; this view stays as it was."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.core.errors import NotFound
from gateway.core.with_model import registry_of


async def prefix_cache(request: Request) -> JSONResponse:
    models = registry_of(request)
    spec = models.find(request.query_params.get("model"))
    lease = models.lease(spec)  # no unload while the view is read
    try:
        served = models.loaded(spec)
        if served is None:
            raise NotFound(
                f"The model {spec.id!r} is not loaded, so it has no prefix cache now; a "
                "request to it loads it.",
                param="model",
                code="model_not_loaded",
            )
        runner = served.runner
        if runner is None:
            raise NotFound("this server has no prefix cache")
        # the view waits briefly for a running request: keep it off the event loop
        view = await run_in_threadpool(runner.prefix_cache_view)
    finally:
        lease.release()
    return JSONResponse(view)


ROUTES = [
    Route("/debug/prefix-cache", prefix_cache, methods=["GET"]),
]
