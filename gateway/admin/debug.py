"""GET /debug/prefix-cache: the prefix trie's statistics and a dump of its nodes."""

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
    # the dump waits for the running request to finish: keep it off the event loop
    dump = await run_in_threadpool(runner.dump_prefix_cache)
    return JSONResponse({"stats": runner.prefix.stats(), "trie": dump.splitlines()})
