"""GET /admin/events: GET /admin/state's document (gateway/admin/state.py) as a stream of
server-sent events, for a page that shows the engine live.

    event: state
    data: {"object": "admin.state", ...}

One when the stream opens; then one whenever a held model's running batch or prefix
trie changes (at most every `MIN_GAP_S`), every `PROGRESS_S` while requests run (their
progress moves without an event), and after a model loads or unloads; `: ping` comments
keep a quiet stream open. Same key, `?model=` and prompt-text rule as /admin/state. Read
it with fetch (the key travels as a header; EventSource cannot send one).

The engine tells the stream that something changed (a listener on each runner's activity,
runtime/engine/activity.py, wakes it); the stream reads the views the engine published
and never waits on the engine's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.routing import Route

from gateway.admin.state import shows_prompts, state_body, versions
from gateway.core.models import ModelRegistry
from gateway.core.with_model import registry_of
from runtime.engine import Activity

MIN_GAP_S = 0.25  # between two events: a busy server changes state many times a second
PROGRESS_S = 1.0  # while requests run
QUIET_S = 5.0  # otherwise (a model loading or unloading tells no activity)
PING_S = 15


def _activities(models: ModelRegistry) -> dict[int, Activity]:
    out = {}
    for status in models.status():
        runner = None if status.served is None else status.served.runner
        if runner is not None:
            out[id(runner.activity)] = runner.activity
    return out


def _busy(models: ModelRegistry) -> bool:
    return any(
        s.queue_depth or (s.served and s.served.runner and s.served.runner.activity.view.rows)
        for s in models.status()
    )


class _Watch:
    """The activities this stream listens to, kept in step with the loaded models."""

    def __init__(self, poke: Callable[[], None]) -> None:
        self.poke = poke
        self.watched: dict[int, Activity] = {}

    def update(self, models: ModelRegistry) -> None:
        now = _activities(models)
        for key in self.watched.keys() - now.keys():
            self.watched.pop(key).unlisten(self.poke)
        for key in now.keys() - self.watched.keys():
            self.watched[key] = now[key]
            now[key].listen(self.poke)

    def close(self) -> None:
        for activity in self.watched.values():
            activity.unlisten(self.poke)
        self.watched.clear()


async def state_events(
    models: ModelRegistry, model: str | None, shown: bool
) -> AsyncIterator[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    poked = asyncio.Event()

    def poke() -> None:  # on the engine's thread
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
            loop.call_soon_threadsafe(poked.set)

    watch = _Watch(poke)
    sent: tuple[object, ...] | None = None
    try:
        while True:
            poked.clear()  # before reading: a change from now on wakes the wait below
            watch.update(models)
            seen = versions(models)
            if seen != sent:
                body = await run_in_threadpool(state_body, models, model, shown)
                sent = seen
                yield {"event": "state", "data": json.dumps(body)}
                await asyncio.sleep(MIN_GAP_S)
            wait = PROGRESS_S if _busy(models) else QUIET_S
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(poked.wait(), wait)
    finally:
        watch.close()


async def events(request: Request) -> EventSourceResponse:
    models = registry_of(request)
    model = request.query_params.get("model")
    if model is not None:
        models.find(model)  # an unknown name is a 404 now, not an empty stream
    stream = state_events(models, model, shows_prompts(request))
    return EventSourceResponse(stream, ping=PING_S, send_timeout=30)


ROUTES = [
    Route("/admin/events", events, methods=["GET"]),
]
