"""POST /v1/chat/completions, streaming and not, with n choices, reasoning and tool calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from anyio import to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import parsers
from gateway import adapters
from gateway.capabilities import tool_call_opener
from gateway.chat_output import ChatOutput
from gateway.errors import InvalidRequest, Unprocessable
from gateway.generation import (
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
from gateway.http import read_json, served_model, server_settings, validate
from gateway.openai_format import FINISH, ChatStream, Usage, logprobs_content
from gateway.protocol.openai import ChatCompletionRequest
from gateway.served import ServedModel
from runtime.types import Finished, FinishReason, TextDelta, TokenLogprob
from templates import TemplateError


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
        raise Unprocessable(
            f"The model's chat template rejected these messages: {exc}",
            param="messages",
            code="template_error",
        ) from None


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


def _check_chat(served: ServedModel) -> None:
    if not served.caps.chat:
        raise InvalidRequest(
            f"The model {served.id!r} has no chat template, so chat messages cannot be "
            "rendered; send a raw prompt to /v1/completions instead.",
            param="messages",
            code="model_has_no_chat_template",
        )


async def chat_completions(request: Request) -> Response:
    served = served_model(request)
    settings = server_settings(request)
    req = validate(ChatCompletionRequest, await read_json(request))
    served.check_model(req.model)
    _check_chat(served)
    plan = adapters.chat_plan(req, vocab_size=served.vocab_size, tools_supported=served.caps.tools)
    # rendering and tokenizing a long conversation takes a while: keep it off the event loop
    prep = await to_thread.run_sync(prepare, served, plan)
    max_tokens = budget(
        served, settings, len(prep.tokens), plan.max_tokens, param=plan.max_tokens_field
    )
    # one parser per choice, made before anything is queued, so a bad one is a plain error
    readers = [_new_parser(prep, plan) for _ in range(plan.n)]
    wanted = requests_for(prep.tokens, max_tokens, plan.sampling, plan.stop, plan.n)
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
    plan: adapters.ChatPlan,
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
        for delta in out.deltas(parser.finish()):
            yield sse_data(fmt.chunk(delta, index=index))
        error = failure(event)
        if error is not None:
            raise error  # sent as an SSE error event by the response's guard
        if event.reason is not FinishReason.CANCELLED:
            reason = _finish_reason(event, out)
            yield sse_data(fmt.chunk({}, index=index, finish_reason=reason))


async def _stream(
    gens: Generations, fmt: ChatStream, plan: adapters.ChatPlan, readers: list[parsers.Parser]
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
    gens: Generations, index: int, plan: adapters.ChatPlan, parser: parsers.Parser
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
    state.out.deltas(parser.finish())
    assert state.done is not None
    error = failure(state.done)
    if error is not None:
        raise error
    return state


async def _collect(
    gens: Generations, fmt: ChatStream, plan: adapters.ChatPlan, readers: list[parsers.Parser]
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
