"""A plan -> prompt tokens and a parser: the part of every chat-like request that is
the same whatever the dialect (render, check capabilities, force a tool call, encode)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import parsers
from gateway.core.capabilities import tool_call_opener
from gateway.core.errors import InvalidRequest, Unprocessable
from gateway.core.images import (
    expand_rendered,
    image_sources,
    place_images,
    read_images,
    require_vision,
)
from gateway.core.models import ServedModel
from gateway.core.plan import ChatPlan, has_images
from gateway.core.structured import forced_call, request_constraint
from parsers.events import Event
from runtime.types import Constraint, PromptImage, ReasoningBudget
from runtime.vision import PreparedImage
from templates import TURN_OPENERS, Rendered, TemplateError, render_prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A rendered request: prompt tokens, and how to read what the model writes."""

    tokens: list[int]
    parser_name: str
    think: parsers.ThinkMode
    prefix: str  # text the prompt ends with that belongs to the reply (forced tool call)
    reasoning: ReasoningBudget | None = None  # closes the reasoning block after N tokens
    boundaries: tuple[int, ...] = ()  # where each message starts, in tokens
    constraint: Constraint | None = None  # the grammar the output keeps to
    images: tuple[PromptImage, ...] = ()  # preprocessed, placed on their token spans
    prediction: tuple[int, ...] = ()  # the plan's predicted output, as tokens


def check_generates(served: ServedModel, endpoint: str) -> None:
    """A 400 for an embedding model or cross-encoder asked to generate text."""
    task = served.caps.task
    if not served.caps.generates:
        where = "/v1/embeddings" if task == "embed" else "/v1/rerank"
        raise InvalidRequest(
            f"The model {served.id!r} is an {'embedding' if task == 'embed' else 'reranking'} "
            f"model: it generates no text, so {endpoint} cannot use it. Send it to {where}, "
            "or name a chat model.",
            param="model",
            code="model_not_generative",
        )


def check_chat(served: ServedModel, *, param: str = "messages") -> None:
    check_generates(served, "chat")
    if not served.caps.chat:
        raise InvalidRequest(
            f"The model {served.id!r} has no chat template, so chat messages cannot be "
            "rendered; send a raw prompt to /v1/completions instead.",
            param=param,
            code="model_has_no_chat_template",
        )


def render(served: ServedModel, plan: ChatPlan) -> Rendered:
    if has_images(plan.messages) and not served.vision:
        raise InvalidRequest(
            f"The model {served.id!r} has no vision: send text content only, or serve a "
            "model with vision.",
            param=plan.messages_field,
            code="model_has_no_vision",
        )
    try:
        return render_prompt(
            served.renderer, plan.messages, plan.tools.tools, plan.options, served.controls
        )
    except TemplateError as exc:
        raise Unprocessable(
            f"The model's chat template rejected these messages: {exc}",
            param=plan.messages_field,
            code="template_error",
        ) from None


def prepare(served: ServedModel, plan: ChatPlan) -> Prepared:
    """Render and encode (slow for long conversations: call it off the event loop);
    images are fetched, decoded and preprocessed here too."""
    rendered = render(served, plan)
    sources = image_sources(plan.messages)
    spec = require_vision(served.loaded.vision, served.id, plan.messages_field) if sources else None
    read: list[PreparedImage] = []
    if spec is not None:
        # read first: how many tokens an image takes may depend on its size
        read = read_images(spec, sources, served.image_policy, plan.messages_field)
        lengths = [spec.tokens(image.shape) for image in read]
        rendered = expand_rendered(rendered, spec, len(sources), plan.messages_field, lengths)
    text = rendered.text
    caps = served.caps
    think: parsers.ThinkMode = parsers.think_mode(text) if caps.thinking else False
    prefix = ""
    forced = forced_call(plan, caps.parser, served.loaded.tokenizer)
    if forced is not None:
        # the format's grammar names a declared tool and keeps to its schema
        prefix = ("</think>\n\n" if think == "open" else "") + forced.opener
    elif plan.tools.choice in ("required", "named"):
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
    # message text is tokenized as plain text: only the template's markup is control tokens
    tokens = served.loaded.tokenizer.encode_prompt(text + prefix, content=rendered.content)
    # a forced call closes an open block itself: the budget then has nothing to bound
    inside = think == "open" and not prefix
    # a template that closed the block itself (thinking off) leaves no reasoning to skip
    lead = False if text.rstrip().endswith("</think>") else think
    constraint = request_constraint(plan, caps.parser, lead, served.loaded.tokenizer, forced)
    images: tuple[PromptImage, ...] = ()
    if spec is not None:
        images = place_images(spec, read, tokens, plan.messages_field)
    predicted: tuple[int, ...] = ()
    if plan.prediction:  # drafts only: a special token in it is checked like any other
        predicted = tuple(served.loaded.tokenizer.encode(plan.prediction, add_special_tokens=False))
    return Prepared(
        tokens, caps.parser, think, prefix, _budget(served, plan, think, inside),
        message_starts(served, tokens), constraint, images, predicted,
    )  # fmt: skip


def message_starts(served: ServedModel, tokens: list[int]) -> tuple[int, ...]:
    """Offsets of the tokens that open a message (restore points for hybrid models)."""
    tok = served.loaded.tokenizer
    ids = {tok.token_to_id(s) for s in TURN_OPENERS} - {None}
    return tuple(i for i, t in enumerate(tokens) if i and t in ids)


def _budget(
    served: ServedModel, plan: ChatPlan, think: parsers.ThinkMode, inside: bool
) -> ReasoningBudget | None:
    if plan.reasoning_budget is None or not think:
        return None
    tok = served.loaded.tokenizer
    close, open_ = tok.token_to_id("</think>"), tok.token_to_id("<think>")
    if close is None:
        log.info(
            "a reasoning budget of %d tokens is not applied: </think> is not one token in "
            "this model's vocabulary",
            plan.reasoning_budget,
        )
        return None
    return ReasoningBudget(plan.reasoning_budget, close, open_, inside)


class _Primed:
    """A parser already fed the forced opener: whatever the opener produced (a
    ToolCallStart, for a named call) comes out ahead of the model's first events."""

    def __init__(self, parser: parsers.Parser, prefix: str) -> None:
        self._parser = parser
        self._pending = parser.feed(prefix)

    def _take(self, events: list[Event]) -> list[Event]:
        if not self._pending:
            return events
        out, self._pending = [*self._pending, *events], []
        return out

    def feed(self, text: str) -> list[Event]:
        return self._take(self._parser.feed(text))

    def finish(self, *, truncated: bool = False) -> list[Event]:
        return self._take(self._parser.finish(truncated=truncated))


def new_parser(prep: Prepared, plan: ChatPlan) -> parsers.Parser:
    parser = parsers.create(prep.parser_name, tools=plan.tools.schemas or None, think=prep.think)
    # the opener is part of the reply: the model continues from inside it
    return _Primed(parser, prep.prefix) if prep.prefix else parser
