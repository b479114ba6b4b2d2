"""A bound on the requests being prepared: rendered, tokenized, their images fetched,
before the engine's bounded queue takes them.

That work runs on anyio's worker threads (40 by default). Unbounded, a crowd of
requests (or a few with slow image hosts) waits for threads invisibly, each holding its
body, and nothing else that needs a thread gets one. Beyond the bound a request is
refused at once: a 429 with Retry-After in its dialect, as a full queue answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from anyio import to_thread
from starlette.requests import Request

from gateway.core.errors import RateLimited
from gateway.core.settings import DEFAULT_MAX_PREPARING

T = TypeVar("T")


class Preparing:
    """Counts the requests in preparation; only the event loop touches the count."""

    def __init__(self, limit: int = DEFAULT_MAX_PREPARING, retry_after: int = 2) -> None:
        if limit < 1:
            raise ValueError("the preparation bound must be at least 1")
        self.limit = limit
        self.retry_after = retry_after
        self.busy = 0

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` on a worker thread, as one of at most `limit` at once."""
        if self.busy >= self.limit:
            raise RateLimited(
                f"The server is busy: {self.busy} requests are being prepared (rendered, "
                f"tokenized, their images fetched), the most it takes at once "
                "(--max-preparing); retry shortly.",
                code="too_many_preparing",
                headers={"Retry-After": str(self.retry_after)},
            )
        self.busy += 1
        try:
            # a client that leaves does not cancel the thread: the slot is held until
            # the work really ends
            return await to_thread.run_sync(work)
        finally:
            self.busy -= 1


async def prepare_off_loop(request: Request, work: Callable[[], T]) -> T:
    """`work()` off the event loop under the app's preparation bound (an app built
    without one, in a unit test, gets the default)."""
    gate = getattr(request.app.state, "preparing", None)
    if not isinstance(gate, Preparing):
        gate = request.app.state.preparing = Preparing()
    return await gate.run(work)
