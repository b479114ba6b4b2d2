"""POST /v1/responses (streaming and not), GET and DELETE /v1/responses/{id}.

A request becomes a neutral plan (adapt), runs as one generation, and its
parser events become output items (responses_emit). With `store` (OpenAI's default)
the finished response is kept in the app's bounded store (responses_store), so a
later request can continue it with `previous_response_id`.

`truncation: "auto"` drops the oldest turns of a conversation that does not fit the
context (a turn: a user message and everything after it up to the next one; system
messages at the start and the last turn are always kept), re-rendering until it fits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import parsers
from gateway.core.errors import APIError, NotFound
from gateway.core.generation import (
    Generations,
    budget,
    requests_for,
    sse_response,
    submit,
    until_disconnect,
)
from gateway.core.http import read_model, server_settings
from gateway.core.models import ServedModel
from gateway.core.plan import ChatPlan
from gateway.core.prepare import Prepared, check_chat, new_parser, prepare
from gateway.core.preparing import prepare_off_loop
from gateway.core.reply import Reply, parsed
from gateway.core.settings import ServerSettings
from gateway.core.with_model import with_model
from gateway.openai.responses.adapt import Adapted, response_plan
from gateway.openai.responses.emit import Payload, ResponseBuilder, envelope
from gateway.openai.responses.store import ResponseStore, responses_state
from gateway.openai.responses.wire import ResponsesRequest
from templates.types import Message

log = logging.getLogger(__name__)


async def create_response(request: Request) -> Response:
    req = await read_model(request, ResponsesRequest)
    return await with_model(
        request, req.model, partial(_respond, request, req), stream=req.stream, on_error=_error
    )


def _error(err: APIError) -> list[dict[str, Any]]:
    """An error before the stream's first event (its model failed to load, or the request
    does not fit it): the Responses API's `error` event."""
    return _sse([{"type": "error", "code": err.code, "message": err.message,
                  "param": err.param, "sequence_number": 0}])  # fmt: skip


async def _respond(request: Request, req: ResponsesRequest, served: ServedModel) -> Response:
    settings = server_settings(request)
    state = responses_state(request.app)
    check_chat(served, param="input")
    history = state.store.history(req.previous_response_id) if req.previous_response_id else []
    adapted = response_plan(
        req,
        history=history,
        lookup=state.store.item,
        open_sealed=state.seal.open,
        tools_supported=served.caps.tools,
        defaults=served.sampling_defaults,
    )
    auto = req.truncation == "auto"
    # rendering and tokenizing a long conversation takes a while: keep it off the event loop
    fitted = partial(fit, served, settings, adapted.plan, auto)
    plan, prep = await prepare_off_loop(request, fitted)
    max_tokens = budget(
        served, settings, len(prep.tokens), plan.max_tokens,
        param="max_output_tokens", prompt_param="input",
    )  # fmt: skip
    parser = new_parser(prep, plan)
    wanted = requests_for(
        prep.tokens, max_tokens, plan.sampling, plan.stop, 1,
        pin=plan.pin, boundaries=prep.boundaries, constraint=prep.constraint,
        images=prep.images,
    )  # fmt: skip
    gens = submit(served, wanted, settings, request.app.state.metrics)
    builder = ResponseBuilder(
        envelope(req, served.id, plan),
        adapted.names,
        summary=adapted.summary,
        seal=state.seal.seal if adapted.seal_reasoning else None,
    )
    keep = _keeper(state.store, adapted, req.previous_response_id) if req.store else None
    if plan.stream:
        body = _stream(gens, parser, plan, builder, keep)
        return sse_response(body, gens, settings, on_error=lambda err: _sse(builder.failed(err)))
    work = _collect(gens, parser, plan, builder, keep)
    done = await until_disconnect(request, gens, work)
    return JSONResponse(done if done is not None else {})


async def get_response(request: Request) -> Response:
    stored = responses_state(request.app).store.get(request.path_params["response_id"])
    if stored is None:
        raise _not_found(request.path_params["response_id"])
    return JSONResponse(stored.body)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not responses_state(request.app).store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return NotFound(
        f"No response with id {response_id!r} is stored on this server (responses are "
        "kept in memory only when created with store: true, and the oldest are evicted).",
        param="response_id",
    )


# -- generation -------------------------------------------------------------------------


Keeper = Callable[[Payload], None]


def _keeper(store: ResponseStore, adapted: Adapted, previous: str | None) -> Keeper:
    def keep(body: Payload) -> None:
        # the output goes back in as input items: the next turn reads them as history
        store.put(body, [*adapted.items, *body["output"]], previous)

    return keep


def _sse(payloads: list[Payload]) -> list[dict[str, Any]]:
    return [
        {"event": p["type"], "data": json.dumps(p, ensure_ascii=False)} for p in payloads
    ]  # fmt: skip


async def _stream(
    gens: Generations,
    parser: parsers.Parser,
    plan: ChatPlan,
    builder: ResponseBuilder,
    keep: Keeper | None,
) -> AsyncIterator[dict[str, Any]]:
    for item in _sse(builder.start()):
        yield item
    reply = Reply(parallel=plan.tools.parallel)
    async for events in parsed(gens, 0, parser, reply):
        for item in _sse(builder.feed(events)):
            yield item
    if reply.cancelled:
        return  # the client went away: nobody is left to read the rest
    for item in _sse(builder.finish(reply)):
        yield item
    if keep is not None:
        keep(builder.body)


async def _collect(
    gens: Generations,
    parser: parsers.Parser,
    plan: ChatPlan,
    builder: ResponseBuilder,
    keep: Keeper | None,
) -> Payload:
    reply = Reply(parallel=plan.tools.parallel)
    async for events in parsed(gens, 0, parser, reply):
        builder.feed(events)
    builder.finish(reply)
    if keep is not None:
        keep(builder.body)
    return builder.body


# -- truncation -------------------------------------------------------------------------


def _fits(
    served: ServedModel, settings: ServerSettings, prompt: int, max_tokens: int | None
) -> bool:
    if settings.max_prompt_tokens is not None and prompt > settings.max_prompt_tokens:
        return False
    return prompt + (max_tokens or 1) <= served.context_length


def drop_oldest_turn(messages: tuple[Message, ...]) -> tuple[Message, ...] | None:
    """The conversation without its oldest turn, or None when only one turn is left."""
    lead = 0
    while lead < len(messages) and messages[lead].role == "system":
        lead += 1
    rest = messages[lead:]
    nxt = next((i for i in range(1, len(rest)) if rest[i].role == "user"), None)
    if nxt is None:
        return None
    return messages[:lead] + rest[nxt:]


def fit(
    served: ServedModel, settings: ServerSettings, plan: ChatPlan, auto: bool
) -> tuple[ChatPlan, Prepared]:
    """Render the plan; with truncation auto, drop old turns until it fits (what does
    not fit either way is refused by `budget` with its own message)."""
    prep = prepare(served, plan)
    dropped = 0
    while auto and not _fits(served, settings, len(prep.tokens), plan.max_tokens):
        shorter = drop_oldest_turn(plan.messages)
        if shorter is None:
            break
        dropped += len(plan.messages) - len(shorter)
        plan = dataclasses.replace(plan, messages=shorter)
        prep = prepare(served, plan)
    if dropped:
        log.info("truncation auto: dropped the oldest %d messages to fit the context", dropped)
    return plan, prep


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]
