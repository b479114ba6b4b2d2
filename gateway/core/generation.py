"""Running one API request's generations on the engine, for every route that generates.

`n` choices (or best_of candidates) become consecutive engine requests submitted at
once, so a full queue refuses the whole request up front (429 with Retry-After) and
the prefix cache makes every choice after the first skip the prompt. A client that
goes away cancels them all; the engine notices within one prefill chunk or one
decode step. Streams carry keepalive comments while nothing else is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.types import Message

from gateway.core.errors import (
    APIError,
    EngineFailed,
    InvalidRequest,
    Overloaded,
    RateLimited,
    internal_error,
)
from gateway.core.keepalive import NO_TIMER_PING, with_keepalives
from gateway.core.metrics import Metrics
from gateway.core.models import ServedModel
from gateway.core.plan import CachePin
from gateway.core.settings import ServerSettings
from runtime.engine import (
    EngineFailure,
    EngineState,
    EngineStopped,
    EngineUnavailable,
    QueueFull,
    RequestHandle,
)
from runtime.types import (
    Constraint,
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    PrefixPin,
    PromptImage,
    ReasoningBudget,
    SamplingParams,
    TextDelta,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_SEED_STEP = 0x9E3779B97F4A7C15  # a large odd constant: choices' seeds never collide


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the request's seed (so n=1 and n>1 agree on it); the others get
    distinct seeds derived from it, so a seeded n>1 request is reproducible."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STEP) % (1 << 64)


def requests_for(
    prompt: Sequence[int],
    max_tokens: int,
    sampling: SamplingParams,
    stop: tuple[str, ...],
    count: int,
    *,
    pin: CachePin | None = None,
    reasoning: ReasoningBudget | None = None,
    boundaries: tuple[int, ...] = (),
    constraint: Constraint | None = None,
    images: tuple[PromptImage, ...] = (),
    prediction: tuple[int, ...] = (),
) -> list[GenerationRequest]:
    """`pin` (a plan's CachePin) keeps the prompt's cached prefix ahead in eviction;
    `reasoning` closes the reasoning block after its budget of tokens; `boundaries`
    (where messages start) are restore points for hybrid models' prefix cache;
    `constraint` is the grammar every choice keeps to (a prepared request's);
    `images` sit on their placeholder spans of `prompt`; `prediction`: the tokens the
    reply is expected to repeat (drafted from)."""
    held = None if pin is None else PrefixPin(ttl=pin.ttl, key=pin.key)
    if reasoning is not None:
        sampling = dataclasses.replace(sampling, reasoning_budget=reasoning)
    return [
        GenerationRequest(
            tuple(prompt),
            max_tokens,
            dataclasses.replace(sampling, seed=choice_seed(sampling.seed, i)),
            stop,
            pin=held,
            boundaries=boundaries,
            constraint=constraint,
            images=images,
            prediction=prediction,
        )
        for i in range(count)
    ]


class HasContext(Protocol):
    """A model, loaded or as last seen: its context length bounds its output."""

    @property
    def context_length(self) -> int: ...


def output_bound(served: HasContext, settings: ServerSettings) -> int:
    """The most a request that sets no output limit generates (before its prompt takes
    its share of the context): --default-max-tokens, within --max-tokens-cap."""
    bounds = (settings.default_max_tokens, settings.max_tokens_cap, served.context_length - 1)
    return min(b for b in bounds if b is not None)


def output_limit(served: HasContext, settings: ServerSettings) -> int:
    """The most any one request may generate: --max-tokens-cap, within the context."""
    room = served.context_length - 1
    return room if settings.max_tokens_cap is None else min(room, settings.max_tokens_cap)


def budget(
    served: ServedModel,
    settings: ServerSettings,
    prompt_tokens: int,
    max_tokens: int | None,
    *,
    param: str = "max_tokens",
    prompt_param: str = "messages",
) -> int:
    """max_tokens to generate, after the context and the server's own caps: an ask
    beyond them is clamped (a 400 with --strict-max-tokens), none asked gets
    --default-max-tokens; a prompt that alone does not fit is a 400."""
    return served.check_fits(
        prompt_tokens,
        max_tokens,
        prompt_cap=settings.max_prompt_tokens,
        tokens_cap=settings.max_tokens_cap,
        default=settings.default_max_tokens,
        strict=settings.strict_max_tokens,
        tokens_param=param,
        prompt_param=prompt_param,
    )


class Generations:
    """The engine handles of one API request, in choice order."""

    def __init__(self, handles: list[RequestHandle], metrics: Metrics) -> None:
        self.handles = handles
        self.metrics = metrics

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()  # a no-op for a finished one

    async def events(self, index: int) -> AsyncIterator[GenerationEvent]:
        """Choice `index`'s events, timing its first token and recording its finish."""
        handle = self.handles[index]
        first = True
        async for event in handle:
            if isinstance(event, TextDelta):
                if first and event.token_ids:
                    first = False
                    self.metrics.first_token(time.perf_counter() - handle.submitted_at)
            else:
                self.metrics.generation_done(event.reason, event.stats)
            yield event


def submit(
    served: ServedModel,
    requests: Sequence[GenerationRequest],
    settings: ServerSettings,
    metrics: Metrics,
    *,
    param: str = "n",
) -> Generations:
    """Queue all of one API request's generations, or none of them."""
    engine = served.engine
    if len(requests) > engine.capacity:
        raise InvalidRequest(
            f"This request needs {len(requests)} generations; this server queues at most "
            f"{engine.capacity} at once. Ask for fewer choices.",
            param=param,
        )
    retry = {"Retry-After": str(settings.retry_after_seconds)}
    try:
        handles = engine.submit_all(requests)
    except QueueFull as exc:
        raise RateLimited(
            f"The server is busy ({exc}); retry shortly.", code="queue_full", headers=retry
        ) from None
    except EngineUnavailable as exc:
        raise _refused(exc, settings.retry_after_seconds) from None
    except EngineStopped:
        raise Overloaded(
            "The server is not running generations now; retry shortly.", headers=retry
        ) from None
    return Generations(handles, metrics)


def _refused(exc: EngineUnavailable, retry_after: int) -> APIError:
    """503s for an engine that is draining (shutdown), or failed or stalled (restarting)."""
    why = str(exc)
    message = f"{why[:1].upper()}{why[1:]}; retry shortly."
    if exc.state is EngineState.DRAINING:
        retry = {"Retry-After": str(retry_after)}
        return Overloaded(message, code="shutting_down", headers=retry)
    return EngineFailed(message, retry_after=retry_after)


def failure(done: Finished) -> APIError | None:
    """The error a finished generation stands for, if any."""
    if isinstance(done, EngineFailure):  # the engine failed under it: a 503 to retry
        log.warning("generation ended by an engine failure: %s", done.error)
        return EngineFailed(f"Generation failed: {done.error}; retry shortly.")
    if done.reason is FinishReason.ERROR:
        return internal_error(log, f"generation failed: {done.error}", code="generation_failed")
    if done.reason is FinishReason.CANCELLED and done.error:
        return Overloaded(
            f"Generation stopped: {done.error}; retry shortly.", headers={"Retry-After": "5"}
        )
    return None


async def until_disconnect(request: Request, gens: Generations, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling the generations if the client disconnects first
    (then None: nobody is left to answer)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        gens.cancel()
        task.cancel()
        return None
    gens.cancel()
    return task.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse_data(payload: dict[str, Any]) -> dict[str, Any]:
    return {"data": json.dumps(payload, ensure_ascii=False)}


DONE = {"data": "[DONE]"}


ErrorEvents = Callable[[APIError], list[dict[str, Any]]]


def openai_error_events(err: APIError) -> list[dict[str, Any]]:
    return [sse_data(err.openai_body()), DONE]


async def errors_as_events(
    body: AsyncIterator[Any], on_error: ErrorEvents, *, began: bool
) -> AsyncIterator[Any]:
    """An error while a stream runs goes out as the dialect's SSE error event(s): the
    status line is already sent, and a dropped connection would tell the client nothing.
    `began`: whether the route's own stream had started (for the log)."""
    try:
        async for item in body:
            yield item
    except APIError as exc:
        for item in on_error(exc):
            yield item
    except Exception as exc:
        what = "stream failed" if began else "stream failed before it began"
        for item in on_error(internal_error(log, what, exc=exc)):
            yield item
    finally:
        if isinstance(body, AsyncGenerator):
            with contextlib.suppress(Exception):
                await body.aclose()


async def _guarded(
    body: AsyncIterator[dict[str, Any]], gens: Generations, on_error: ErrorEvents
) -> AsyncIterator[dict[str, Any]]:
    """The route's stream, its errors as events; the generations cancelled at the end."""
    try:
        async for item in errors_as_events(body, on_error, began=True):
            yield item
    finally:
        gens.cancel()  # frees the engine when the client left mid-stream


def sse_response(
    body: AsyncIterator[dict[str, Any]],
    gens: Generations,
    settings: ServerSettings,
    *,
    on_error: ErrorEvents = openai_error_events,
    ping: Callable[[], ServerSentEvent] | None = None,
) -> EventSourceResponse:
    """`ping` makes the keepalive a named event (Anthropic's `event: ping`) instead of
    an SSE comment."""

    async def client_gone(_: Message) -> None:
        gens.cancel()

    return EventSourceResponse(
        with_keepalives(_guarded(body, gens, on_error), settings.keepalive_seconds, ping),
        ping=NO_TIMER_PING,  # keepalives only while idle, never after the last event
        send_timeout=30,
        client_close_handler_callable=client_gone,
    )
