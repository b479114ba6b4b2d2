"""POST /v1/messages (streaming and not), POST /v1/messages/count_tokens, and the
probes Claude Code sends (GET and HEAD / and /api/hello).

Errors on these paths are Anthropic-shaped (gateway/core/errors.body_for); an error
after a stream began goes out as an `event: error`. The anthropic-version and
anthropic-beta headers are accepted: every version and beta this server knows of
reads the same here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import parsers
from gateway.anthropic import adapt
from gateway.anthropic.emit import MessageOutput, stop_event
from gateway.anthropic.wire import CountTokensRequest, MessagesRequest
from gateway.core.errors import APIError, InvalidRequest, Unprocessable
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
from gateway.core.with_model import with_model

log = logging.getLogger(__name__)


def error_events(err: APIError) -> list[dict[str, Any]]:
    return [{"event": "error", "data": json.dumps(err.anthropic_body(), ensure_ascii=False)}]


def ping_event() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data='{"type": "ping"}')


def prepare_messages(served: ServedModel, plan: ChatPlan) -> Prepared:
    """Render and encode; a template that accepts a system message only first gets
    the later ones folded into user turns (Claude Code sends them mid-conversation)."""
    try:
        return prepare(served, plan)
    except Unprocessable:
        folded = adapt.fold_system(plan.messages)
        if folded is None:
            raise
        log.debug("the chat template refused a later system turn; folded into user turns")
        return prepare(served, replace(plan, messages=folded))


def check_prompt_fits(served: ServedModel, prompt_tokens: int) -> None:
    """Anthropic's wording: Claude Code reads "prompt is too long" as its cue to compact."""
    most = served.context_length - 1  # one token must be left to generate
    if prompt_tokens > most:
        raise InvalidRequest(
            f"prompt is too long: {prompt_tokens} tokens > {most} maximum "
            f"({prompt_tokens - most} tokens over this model's {served.context_length}-token "
            "context); shorten the conversation",
            param="messages",
            code="context_length_exceeded",
        )


def _log_headers(request: Request) -> None:
    beta = request.headers.get("anthropic-beta")
    if beta:
        log.debug("anthropic-beta %s (accepted)", beta)


async def messages(request: Request) -> Response:
    req = await read_model(request, MessagesRequest)
    _log_headers(request)
    return await with_model(
        request,
        req.model,
        partial(_answer, request, req),
        stream=req.stream,
        on_error=error_events,
        ping=ping_event,
    )


async def _answer(request: Request, req: MessagesRequest, served: ServedModel) -> Response:
    settings = server_settings(request)
    check_chat(served)
    plan = adapt.chat_plan(
        req, tools_supported=served.caps.tools, defaults=served.sampling_defaults
    )
    # rendering and tokenizing a long conversation takes a while: keep it off the event loop
    prep = await prepare_off_loop(request, partial(prepare_messages, served, plan))
    check_prompt_fits(served, len(prep.tokens))
    max_tokens = budget(served, settings, len(prep.tokens), plan.max_tokens)
    parser = new_parser(prep, plan)
    wanted = requests_for(
        prep.tokens, max_tokens, plan.sampling, plan.stop, 1,
        pin=plan.pin, reasoning=prep.reasoning, boundaries=prep.boundaries,
        constraint=prep.constraint, images=prep.images,
    )  # fmt: skip
    gens = submit(served, wanted, settings, request.app.state.metrics)
    out = MessageOutput(
        model=req.model,
        prompt_tokens=len(prep.tokens),
        warm_only=req.max_tokens == 0,
        omit_thinking=bool(req.thinking and req.thinking.display == "omitted"),
    )
    reply = Reply(parallel=plan.tools.parallel)
    if plan.stream:
        return sse_response(
            _stream(gens, parser, out, reply),
            gens,
            settings,
            on_error=error_events,
            ping=ping_event,
        )
    body = await until_disconnect(request, gens, _collect(gens, parser, out, reply))
    return JSONResponse(body if body is not None else {})


async def _stream(
    gens: Generations, parser: parsers.Parser, out: MessageOutput, reply: Reply
) -> AsyncIterator[dict[str, Any]]:
    yield out.start()
    async for events in parsed(gens, 0, parser, reply):
        for item in out.feed(events):
            yield item
    if reply.done is None or reply.cancelled:
        return  # the client went away: nobody is left to read the rest
    for item in out.close():
        yield item
    yield out.delta(reply.done)
    yield stop_event()


async def _collect(
    gens: Generations, parser: parsers.Parser, out: MessageOutput, reply: Reply
) -> dict[str, Any]:
    async for events in parsed(gens, 0, parser, reply):
        out.feed(events)
    out.close()
    assert reply.done is not None
    return out.body(reply.done)


async def count_tokens(request: Request) -> Response:
    req = await read_model(request, CountTokensRequest)
    return await with_model(request, req.model, partial(_count, request, req))


async def _count(request: Request, req: CountTokensRequest, served: ServedModel) -> Response:
    check_chat(served)
    plan = adapt.prompt_plan(
        req, tools_supported=served.caps.tools, defaults=served.sampling_defaults
    )
    prep = await prepare_off_loop(request, partial(prepare_messages, served, plan))
    return JSONResponse({"input_tokens": len(prep.tokens)})


async def root(request: Request) -> Response:
    """Claude Code probes the base URL (HEAD /) and preconnects with HEAD /api/hello."""
    return JSONResponse({"name": "mlx-gateway", "status": "ok"})


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    Route("/", root, methods=["GET", "HEAD"]),
    Route("/api/hello", root, methods=["GET", "HEAD"]),
]
