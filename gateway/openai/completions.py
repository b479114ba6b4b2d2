"""POST /v1/completions: raw prompts (text, texts or token ids), no chat template.

Choices are numbered prompt by prompt: prompt p's choice j has index p * n + j. With
best_of > n, best_of candidates run per prompt and the n with the highest mean token
logprob are returned (all of them count in usage, as OpenAI bills them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.core.errors import InvalidRequest
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
from gateway.core.prepare import check_generates
from gateway.core.preparing import prepare_off_loop
from gateway.core.settings import ServerSettings
from gateway.core.with_model import with_model
from gateway.openai import adapt as adapters
from gateway.openai.emit import FINISH, TextStream, Usage, legacy_logprobs
from gateway.openai.wire import CompletionRequest
from runtime.types import Finished, FinishReason, GenerationRequest, TextDelta, TokenLogprob


@dataclass(frozen=True)
class _Prompt:
    tokens: tuple[int, ...]
    text: str  # what echo returns: the prompt as sent, or its token ids decoded


def _encode(served: ServedModel, prompts: tuple[adapters.Prompt, ...]) -> list[_Prompt]:
    tok = served.loaded.tokenizer
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            item = _Prompt(tuple(tok.encode_prompt(prompt)), prompt)
        else:
            item = _Prompt(prompt, tok.decode(prompt, skip_special_tokens=False))
        if not item.tokens:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise InvalidRequest(f"{where} encodes to no tokens; send some text", param=where)
        out.append(item)
    return out


def _requests(
    served: ServedModel,
    settings: ServerSettings,
    plan: adapters.CompletionPlan,
    prompts: list[_Prompt],
) -> list[GenerationRequest]:
    wanted: list[GenerationRequest] = []
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        max_tokens = budget(
            served, settings, len(prompt.tokens), plan.max_tokens, prompt_param=where
        )
        wanted += requests_for(prompt.tokens, max_tokens, plan.sampling, plan.stop, plan.best_of)
    return wanted


async def completions(request: Request) -> Response:
    req = await read_model(request, CompletionRequest)
    return await with_model(request, req.model, partial(_complete, request, req), stream=req.stream)


async def _complete(request: Request, req: CompletionRequest, served: ServedModel) -> Response:
    check_generates(served, "/v1/completions")
    settings = server_settings(request)
    plan = adapters.completion_plan(
        req, vocab_size=served.vocab_size, defaults=served.sampling_defaults
    )
    prompts = await prepare_off_loop(request, partial(_encode, served, plan.prompts))
    wanted = _requests(served, settings, plan, prompts)
    fmt = TextStream(model=served.id)
    metrics = request.app.state.metrics
    if plan.max_tokens == 0:  # echo only: nothing to generate
        return _echo_only(
            fmt,
            plan,
            prompts,
            sse=lambda body: sse_response(body, Generations([], metrics), settings),
        )
    gens = submit(served, wanted, settings, metrics, param="best_of" if req.best_of else "n")
    if plan.stream:
        return sse_response(_stream(gens, fmt, plan, prompts), gens, settings)
    body = await until_disconnect(request, gens, _collect(gens, fmt, plan, prompts))
    return JSONResponse(body if body is not None else {})


def _echo_only(
    fmt: TextStream,
    plan: adapters.CompletionPlan,
    prompts: list[_Prompt],
    *,
    sse: Callable[[AsyncIterator[dict[str, Any]]], Response],
) -> Response:
    totals = Usage(prompt_tokens=sum(len(p.tokens) for p in prompts))
    choices = [
        fmt.choice(p * plan.n + j, prompt.text, "length", None)
        for p, prompt in enumerate(prompts)
        for j in range(plan.n)
    ]
    if not plan.stream:
        return JSONResponse(fmt.completion(choices, totals))

    async def body() -> AsyncIterator[dict[str, Any]]:
        for choice in choices:
            yield sse_data(fmt.chunk(choice))
        if plan.include_usage:
            yield sse_data(fmt.usage_chunk(totals))
        yield DONE

    return sse(body())


@dataclass
class _Candidate:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: Finished | None = None

    def mean_logprob(self) -> float:
        if not self.logprobs:
            return float("-inf")
        return sum(lp.logprob for lp in self.logprobs) / len(self.logprobs)


async def _collect_one(gens: Generations, k: int) -> _Candidate:
    cand = _Candidate()
    async for event in gens.events(k):
        if isinstance(event, TextDelta):
            cand.text.append(event.text)
            cand.logprobs.extend(event.logprobs)
        else:
            cand.done = event
    assert cand.done is not None
    error = failure(cand.done)
    if error is not None:
        raise error
    return cand


async def _collect(
    gens: Generations, fmt: TextStream, plan: adapters.CompletionPlan, prompts: list[_Prompt]
) -> dict[str, Any]:
    totals = Usage()
    choices = []
    for p, prompt in enumerate(prompts):
        cands = [await _collect_one(gens, p * plan.best_of + j) for j in range(plan.best_of)]
        for j, cand in enumerate(cands):
            assert cand.done is not None
            totals.add(cand.done.stats, first_of_prompt=j == 0)
        if plan.best_of > plan.n:
            cands = sorted(cands, key=lambda c: c.mean_logprob(), reverse=True)[: plan.n]
        for j, cand in enumerate(cands):
            assert cand.done is not None
            head = prompt.text if plan.echo else ""
            lp = legacy_logprobs(cand.logprobs, len(head)) if plan.logprobs is not None else None
            reason = FINISH.get(cand.done.reason, "stop")
            choices.append(fmt.choice(p * plan.n + j, head + "".join(cand.text), reason, lp))
    return fmt.completion(choices, totals)


async def _stream_one(
    gens: Generations,
    k: int,
    index: int,
    fmt: TextStream,
    plan: adapters.CompletionPlan,
    prompt: _Prompt,
) -> AsyncIterator[dict[str, Any] | Finished]:
    offset = 0
    if plan.echo:
        yield sse_data(fmt.chunk(fmt.choice(index, prompt.text, None, None)))
        offset = len(prompt.text)
    async for event in gens.events(k):
        if isinstance(event, Finished):
            error = failure(event)
            if error is not None:
                raise error
            yield event
            return
        if not event.text and not event.logprobs:
            continue
        lp = legacy_logprobs(event.logprobs, offset) if plan.logprobs is not None else None
        offset += len(event.text)
        yield sse_data(fmt.chunk(fmt.choice(index, event.text, None, lp)))


async def _stream(
    gens: Generations, fmt: TextStream, plan: adapters.CompletionPlan, prompts: list[_Prompt]
) -> AsyncIterator[dict[str, Any]]:
    totals = Usage()
    for p, prompt in enumerate(prompts):
        for j in range(plan.n):
            index = p * plan.n + j  # best_of == n when streaming
            done: Finished | None = None
            async for item in _stream_one(gens, index, index, fmt, plan, prompt):
                if isinstance(item, Finished):
                    done = item
                else:
                    yield item
            if done is None or done.reason is FinishReason.CANCELLED:
                return  # the client went away
            totals.add(done.stats, first_of_prompt=j == 0)
            yield sse_data(fmt.chunk(fmt.choice(index, "", FINISH.get(done.reason, "stop"), None)))
    if plan.include_usage:
        yield sse_data(fmt.usage_chunk(totals))
    yield DONE


ROUTES = [
    Route("/v1/completions", completions, methods=["POST"]),
]
