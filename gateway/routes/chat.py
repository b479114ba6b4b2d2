"""POST /v1/chat/completions, streaming and not, with reasoning and tool calls."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import parsers
from gateway import adapters
from gateway.capabilities import tool_call_opener
from gateway.chat_output import ChatOutput
from gateway.errors import InternalError, InvalidRequest, Overloaded
from gateway.http import read_json, validate
from gateway.openai_format import FINISH, ChatStream, logprobs_content
from gateway.protocol.openai import ChatCompletionRequest
from gateway.served import ServedModel
from runtime.engine import QueueFull, RequestHandle
from runtime.types import Finished, FinishReason, GenerationRequest, TextDelta, TokenLogprob
from templates import TemplateError

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 10


@dataclass(frozen=True)
class Prepared:
    """A rendered request: prompt tokens, and how to read what the model writes."""

    tokens: list[int]
    parser_name: str
    think: parsers.ThinkMode
    prefix: str  # text the prompt ends with that belongs to the reply (forced tool call)


def _render(served: ServedModel, plan: adapters.ChatPlan) -> str:
    if adapters.has_images(plan.messages) and not served.vision:
        raise InvalidRequest(
            f"The model {served.id!r} has no vision: send text content only.",
            param="messages",
            code="model_has_no_vision",
        )
    try:
        return served.renderer.render(plan.messages, plan.tools.tools, plan.options)
    except TemplateError as exc:
        raise InvalidRequest(f"The chat template rejected these messages: {exc}", param="messages") from None


def prepare(served: ServedModel, plan: adapters.ChatPlan) -> Prepared:
    text = _render(served, plan)
    caps = served.caps
    think: parsers.ThinkMode = parsers.think_mode(text) if caps.thinking else False
    prefix = ""
    if plan.tools.choice in ("required", "named"):
        # with one tool, "required" can only mean that tool: name it, so the model
        # cannot wander off into an undeclared one
        only = plan.tools.tools[0].name if len(plan.tools.tools) == 1 else None
        opener = tool_call_opener(caps.parser, plan.tools.name or only)
        if opener is None:
            raise InvalidRequest(
                f"tool_choice {plan.tools.choice!r} cannot be enforced for this model's "
                "tool-call format; use 'auto'",
                param="tool_choice",
            )
        # a prompt that leaves the model inside <think> is closed first: the call comes now
        prefix = ("</think>\n\n" if think == "open" else "") + opener
    tokens = served.loaded.tokenizer.encode_prompt(text + prefix)
    return Prepared(tokens, caps.parser, think, prefix)


def _new_parser(prep: Prepared, plan: adapters.ChatPlan) -> parsers.Parser:
    parser = parsers.create(prep.parser_name, tools=plan.tools.schemas or None, think=prep.think)
    if prep.prefix:
        parser.feed(prep.prefix)  # the opener is part of the reply; it emits nothing yet
    return parser


def _submit(served: ServedModel, request: GenerationRequest) -> RequestHandle:
    try:
        return served.engine.submit(request)
    except QueueFull as exc:
        raise Overloaded(
            f"The server is busy ({exc}); retry shortly.", headers={"Retry-After": "2"}
        ) from None


async def chat_completions(request: Request) -> Response:
    served: ServedModel = request.app.state.served
    req = validate(ChatCompletionRequest, await read_json(request))
    served.check_model(req.model)
    plan = adapters.chat_plan(req, vocab_size=served.vocab_size, tools_supported=served.caps.tools)
    prep = prepare(served, plan)
    max_tokens = served.check_fits(len(prep.tokens), plan.max_tokens)
    handle = _submit(served, GenerationRequest(tuple(prep.tokens), max_tokens, plan.sampling, plan.stop))
    fmt = ChatStream(model=served.id)
    if plan.stream:
        return EventSourceResponse(
            _stream(handle, fmt, plan, _new_parser(prep, plan)), ping=KEEPALIVE_SECONDS, send_timeout=30
        )
    work = _collect(handle, fmt, plan, _new_parser(prep, plan))
    return JSONResponse(await _until_disconnect(request, handle, work))


def _finish_reason(done: Finished, out: ChatOutput) -> str:
    if done.reason is FinishReason.STOP and out.has_calls:
        return "tool_calls"
    return FINISH.get(done.reason, "stop")


async def _stream(
    handle: RequestHandle, fmt: ChatStream, plan: adapters.ChatPlan, parser: parsers.Parser
) -> AsyncIterator[dict[str, Any]]:
    out = ChatOutput(parallel=plan.tools.parallel)
    want_logprobs = plan.sampling.logprobs
    try:
        yield _data(fmt.chunk({"role": "assistant", "content": ""}))
        async for event in handle:
            if isinstance(event, TextDelta):
                events = parser.feed(event.text)
                out.count_tokens(events, len(event.token_ids))
                deltas = out.deltas(events)
                lp = logprobs_content(event.logprobs) if want_logprobs else None
                if lp and not deltas:
                    deltas = [{"content": ""}]
                for i, delta in enumerate(deltas):
                    yield _data(fmt.chunk(delta, logprobs=lp if i == 0 else None))
                continue
            for delta in out.deltas(parser.finish()):
                yield _data(fmt.chunk(delta))
            if event.reason is FinishReason.ERROR:
                log.error("generation failed mid-stream: %s", event.error)
                yield _data(InternalError(f"generation failed: {event.error}").openai_body())
                break
            if event.reason is FinishReason.CANCELLED:
                break
            yield _data(fmt.chunk({}, finish_reason=_finish_reason(event, out)))
            if plan.include_usage:
                yield _data(fmt.usage_chunk(event.stats, out.reasoning_tokens))
        yield {"data": "[DONE]"}
    finally:
        handle.cancel()  # a no-op when finished; frees the engine when the client left


def _data(payload: dict[str, Any]) -> dict[str, Any]:
    return {"data": json.dumps(payload, ensure_ascii=False)}


async def _collect(
    handle: RequestHandle, fmt: ChatStream, plan: adapters.ChatPlan, parser: parsers.Parser
) -> dict[str, Any]:
    out = ChatOutput(parallel=plan.tools.parallel)
    logprobs: list[TokenLogprob] = []
    done: Finished | None = None
    async for event in handle:
        if isinstance(event, TextDelta):
            events = parser.feed(event.text)
            out.count_tokens(events, len(event.token_ids))
            out.deltas(events)
            logprobs.extend(event.logprobs)
        else:
            done = event
    out.deltas(parser.finish())
    assert done is not None
    if done.reason is FinishReason.ERROR:
        raise InternalError(f"generation failed: {done.error}")
    lp = logprobs_content(logprobs) if plan.sampling.logprobs else None
    return fmt.completion(out.message(), _finish_reason(done, out), done.stats, lp, out.reasoning_tokens)


async def _until_disconnect(request: Request, handle: RequestHandle, work: Any) -> Any:
    """Await `work`, cancelling the request if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        handle.cancel()
        task.cancel()
        return {}
    return task.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
