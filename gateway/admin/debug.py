"""GET /debug/prefix-cache: the prefix trie's counters, its nodes, the live pins and the
last requests' cache reports (what each reused, and why not more)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.core.errors import NotFound
from gateway.core.served import ServedModel


async def prefix_cache(request: Request) -> JSONResponse:
    served: ServedModel = request.app.state.served
    runner = served.runner
    if runner is None:
        raise NotFound("this server has no prefix cache")
    # the view waits briefly for a running request: keep it off the event loop
    view = await run_in_threadpool(runner.prefix_cache_view)
    return JSONResponse(view)
