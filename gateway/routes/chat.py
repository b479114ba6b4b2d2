"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import parsers
from gateway import adapters
from gateway.errors import InternalError, InvalidRequest, Overloaded
from gateway.http import read_json, validate
from gateway.openai_format import FINISH, ChatStream, logprobs_content
from gateway.protocol.openai import ChatCompletionRequest
from gateway.served import ServedModel
from parsers.events import Content
from runtime.engine import QueueFull, RequestHandle
from runtime.types import Finished, FinishReason, GenerationRequest, TextDelta, TokenLogprob
from templates import TemplateError

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 10


def _prompt(served: ServedModel, plan: adapters.ChatPlan) -> list[int]:
    if adapters.has_images(plan.messages) and not served.vision:
        raise InvalidRequest(
            f"The model {served.id!r} has no vision: send text content only.",
            param="messages",
            code="model_has_no_vision",
        )
    if served.renderer is None:
        raise InvalidRequest(
            f"The model {served.id!r} has no chat template; use /v1/completions with a raw prompt.",
            param="model",
        )
    try:
        text = served.renderer.render(plan.messages, plan.tools, plan.options)
    except TemplateError as exc:
        raise InvalidRequest(f"The chat template rejected these messages: {exc}", param="messages") from None
    return served.loaded.tokenizer.encode_prompt(text)


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
    plan = adapters.chat_plan(req, vocab_size=served.vocab_size)
    tokens = _prompt(served, plan)
    max_tokens = served.check_fits(len(tokens), plan.max_tokens)
    gen = GenerationRequest(tuple(tokens), max_tokens, plan.sampling, plan.stop)
    handle = _submit(served, gen)
    fmt = ChatStream(model=served.id)
    if plan.stream:
        return EventSourceResponse(
            _stream(handle, fmt, plan), ping=KEEPALIVE_SECONDS, send_timeout=30
        )
    return JSONResponse(await _until_disconnect(request, handle, _collect(handle, fmt, plan)))


async def _stream(
    handle: RequestHandle, fmt: ChatStream, plan: adapters.ChatPlan
) -> AsyncIterator[dict[str, Any]]:
    parser = parsers.create("passthrough")
    want_logprobs = plan.sampling.logprobs
    try:
        yield _data(fmt.chunk({"role": "assistant", "content": ""}))
        async for event in handle:
            if isinstance(event, TextDelta):
                text = "".join(e.text for e in parser.feed(event.text) if isinstance(e, Content))
                lp = logprobs_content(event.logprobs) if want_logprobs else None
                if text or lp:
                    yield _data(fmt.chunk({"content": text}, logprobs=lp))
                continue
            tail = "".join(e.text for e in parser.finish() if isinstance(e, Content))
            if tail:
                yield _data(fmt.chunk({"content": tail}))
            if event.reason is FinishReason.ERROR:
                log.error("generation failed mid-stream: %s", event.error)
                yield _data(InternalError(f"generation failed: {event.error}").openai_body())
                break
            if event.reason is FinishReason.CANCELLED:
                break
            yield _data(fmt.chunk({}, finish_reason=FINISH[event.reason]))
            if plan.include_usage:
                yield _data(fmt.usage_chunk(event.stats))
        yield {"data": "[DONE]"}
    finally:
        handle.cancel()  # a no-op when finished; frees the engine when the client left


def _data(payload: dict[str, Any]) -> dict[str, Any]:
    return {"data": json.dumps(payload, ensure_ascii=False)}


async def _collect(handle: RequestHandle, fmt: ChatStream, plan: adapters.ChatPlan) -> dict[str, Any]:
    parser = parsers.create("passthrough")
    content: list[str] = []
    logprobs: list[TokenLogprob] = []
    done: Finished | None = None
    async for event in handle:
        if isinstance(event, TextDelta):
            content += [e.text for e in parser.feed(event.text) if isinstance(e, Content)]
            logprobs.extend(event.logprobs)
        else:
            done = event
    content += [e.text for e in parser.finish() if isinstance(e, Content)]
    assert done is not None
    if done.reason is FinishReason.ERROR:
        raise InternalError(f"generation failed: {done.error}")
    lp = logprobs_content(logprobs) if plan.sampling.logprobs else None
    return fmt.completion("".join(content), FINISH.get(done.reason, "stop"), done.stats, lp)


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
