"""POST /tokenize and POST /detokenize (vLLM's shapes): the served model's tokenizer,
with chat messages rendered through its template exactly as a chat request would be."""

from __future__ import annotations

from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.core.errors import InvalidRequest, Unprocessable
from gateway.core.http import read_json, validate
from gateway.core.images import expand_rendered, image_sources, read_images, require_vision
from gateway.core.models import ServedModel
from gateway.core.plan import render_options
from gateway.core.preparing import prepare_off_loop
from gateway.core.with_model import with_model
from gateway.openai import adapt as adapters
from gateway.openai.wire import DetokenizeRequest, TokenizeRequest
from templates import TemplateError, render_prompt


def _chat_tokens(served: ServedModel, req: TokenizeRequest) -> list[int]:
    if not served.caps.chat:
        raise InvalidRequest(
            f"The model {served.id!r} has no chat template; tokenize a prompt instead.",
            param="messages",
            code="model_has_no_chat_template",
        )
    messages = adapters.to_messages(req.messages or [])
    tools = adapters.tool_plan(req.tools, None, None, supported=served.caps.tools)
    options = render_options(
        req.chat_template_kwargs, None, add_generation_prompt=req.add_generation_prompt
    )
    try:
        rendered = render_prompt(served.renderer, messages, tools.tools, options, served.controls)
    except TemplateError as exc:
        raise Unprocessable(
            f"The model's chat template rejected these messages: {exc}", param="messages"
        ) from None
    sources = image_sources(messages)
    if sources:
        # each image counts as its placeholder's tokens; the images are read only where
        # that count depends on their size
        spec = require_vision(served.loaded.vision, served.id, "messages")
        lengths = None
        if spec.preprocessing.grid is not None:
            read = read_images(spec, sources, served.image_policy, "messages")
            lengths = [spec.tokens(image.shape) for image in read]
        rendered = expand_rendered(rendered, spec, len(sources), "messages", lengths)
    return served.loaded.tokenizer.encode_prompt(rendered.text, content=rendered.content)


def _tokens(served: ServedModel, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("send exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise InvalidRequest("messages is empty", param="messages")
        return _chat_tokens(served, req)
    assert req.prompt is not None
    return served.loaded.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)


async def tokenize(request: Request) -> Response:
    req = validate(TokenizeRequest, await read_json(request))
    return await with_model(request, req.model, partial(_tokenize, request, req))


async def _tokenize(request: Request, req: TokenizeRequest, served: ServedModel) -> Response:
    tokens = await prepare_off_loop(request, partial(_tokens, served, req))
    return JSONResponse(
        {"tokens": tokens, "count": len(tokens), "max_model_len": served.context_length}
    )


async def detokenize(request: Request) -> Response:
    req = validate(DetokenizeRequest, await read_json(request))
    return await with_model(request, req.model, partial(_detokenize, req))


async def _detokenize(req: DetokenizeRequest, served: ServedModel) -> Response:
    size = served.loaded.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside the vocabulary (0..{size - 1})", param="tokens"
        )
    text = served.loaded.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


ROUTES = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
