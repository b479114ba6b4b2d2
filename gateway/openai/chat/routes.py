"""POST /v1/chat/completions, streaming and not, with n choices, reasoning and tool calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import parsers
from gateway.core.generation import (
    DONE,
    Generations,
    budget,
    failure,
    requests_for,
    sse_data,
    sse_response,
    submit,
    until_disconnect,
)
from gateway.core.http import read_model, server_settings
from gateway.core.models import ServedModel
from gateway.core.plan import ChatPlan
from gateway.core.prepare import check_chat, new_parser, prepare
from gateway.core.preparing import prepare_off_loop
from gateway.core.with_model import with_model
from gateway.openai import adapt as adapters
from gateway.openai.chat.output import ChatOutput
from gateway.openai.emit import FINISH, ChatStream, Usage, logprobs_content
from gateway.openai.wire import ChatCompletionRequest
from runtime.types import Finished, FinishReason, TextDelta, TokenLogprob


async def chat_completions(request: Request) -> Response:
    req = await read_model(request, ChatCompletionRequest)
    return await with_model(request, req.model, partial(_complete, request, req), stream=req.stream)


async def _complete(request: Request, req: ChatCompletionRequest, served: ServedModel) -> Response:
    settings = server_settings(request)
    check_chat(served)
    plan = adapters.chat_plan(
        req,
        vocab_size=served.vocab_size,
        tools_supported=served.caps.tools,
        defaults=served.sampling_defaults,
    )
    # rendering and tokenizing a long conversation takes a while: keep it off the event loop
    prep = await prepare_off_loop(request, partial(prepare, served, plan))
    max_tokens = budget(
        served, settings, len(prep.tokens), plan.max_tokens, param=plan.max_tokens_field
    )
    # one parser per choice, made before anything is queued, so a bad one is a plain error
    readers = [new_parser(prep, plan) for _ in range(plan.n)]
    wanted = requests_for(
        prep.tokens, max_tokens, plan.sampling, plan.stop, plan.n,
        pin=plan.pin, boundaries=prep.boundaries, constraint=prep.constraint,
        images=prep.images, prediction=prep.prediction,
    )  # fmt: skip
    gens = submit(served, wanted, settings, request.app.state.metrics)
    fmt = ChatStream(model=served.id)
    if plan.stream:
        return sse_response(_stream(gens, fmt, plan, readers), gens, settings)
    body = await until_disconnect(request, gens, _collect(gens, fmt, plan, readers))
    return JSONResponse(body if body is not None else {})


def _finish_reason(done: Finished, out: ChatOutput) -> str:
    if done.reason is FinishReason.STOP and out.has_calls:
        return "tool_calls"
    return FINISH.get(done.reason, "stop")


@dataclass
class _Choice:
    out: ChatOutput
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: Finished | None = None


async def _stream_choice(
    gens: Generations,
    index: int,
    fmt: ChatStream,
    plan: ChatPlan,
    parser: parsers.Parser,
    state: _Choice,
) -> AsyncIterator[dict[str, Any]]:
    out = state.out
    yield sse_data(fmt.chunk({"role": "assistant", "content": ""}, index=index))
    async for event in gens.events(index):
        if isinstance(event, TextDelta):
            events = parser.feed(event.text)
            out.count_tokens(events, len(event.token_ids))
            deltas = out.deltas(events)
            lp = logprobs_content(event.logprobs) if plan.sampling.logprobs else None
            if lp and not deltas:
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                yield sse_data(fmt.chunk(delta, index=index, logprobs=lp if i == 0 else None))
            continue
        state.done = event
        for delta in out.deltas(parser.finish(truncated=event.reason is FinishReason.LENGTH)):
            yield sse_data(fmt.chunk(delta, index=index))
        error = failure(event)
        if error is not None:
            raise error  # sent as an SSE error event by the response's guard
        if event.reason is not FinishReason.CANCELLED:
            reason = _finish_reason(event, out)
            yield sse_data(fmt.chunk({}, index=index, finish_reason=reason))


async def _stream(
    gens: Generations, fmt: ChatStream, plan: ChatPlan, readers: list[parsers.Parser]
) -> AsyncIterator[dict[str, Any]]:
    totals = Usage()
    for index, parser in enumerate(readers):
        state = _Choice(ChatOutput(parallel=plan.tools.parallel))
        async for item in _stream_choice(gens, index, fmt, plan, parser, state):
            yield item
        if state.done is None or state.done.reason is FinishReason.CANCELLED:
            return  # the client went away: nobody is left to read the rest
        totals.add(
            state.done.stats,
            first_of_prompt=index == 0,
            reasoning_tokens=state.out.reasoning_tokens,
        )
    if plan.include_usage:
        yield sse_data(fmt.usage_chunk(totals))
    yield DONE


async def _collect_choice(
    gens: Generations, index: int, plan: ChatPlan, parser: parsers.Parser
) -> _Choice:
    state = _Choice(ChatOutput(parallel=plan.tools.parallel))
    async for event in gens.events(index):
        if isinstance(event, TextDelta):
            events = parser.feed(event.text)
            state.out.count_tokens(events, len(event.token_ids))
            state.out.deltas(events)
            state.logprobs.extend(event.logprobs)
        else:
            state.done = event
    assert state.done is not None
    state.out.deltas(parser.finish(truncated=state.done.reason is FinishReason.LENGTH))
    error = failure(state.done)
    if error is not None:
        raise error
    return state


async def _collect(
    gens: Generations, fmt: ChatStream, plan: ChatPlan, readers: list[parsers.Parser]
) -> dict[str, Any]:
    totals = Usage()
    choices = []
    for index, parser in enumerate(readers):
        state = await _collect_choice(gens, index, plan, parser)
        assert state.done is not None
        out = state.out
        totals.add(
            state.done.stats, first_of_prompt=index == 0, reasoning_tokens=out.reasoning_tokens
        )
        lp = logprobs_content(state.logprobs) if plan.sampling.logprobs else None
        choices.append(fmt.choice(index, out.message(), _finish_reason(state.done, out), lp))
    return fmt.completion(choices, totals)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
