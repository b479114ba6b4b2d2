"""Responses requests -> the neutral plan: input items to template messages, tools
(function, custom, namespace; hosted ones left out), tool_choice, sampling, reasoning.

Every field is honoured, refused with a 400 naming it, or (when a client always sends
it and it means nothing on a local server) left out with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.core.limits import MAX_MESSAGES, check_count
from gateway.core.plan import (
    CachePin,
    ChatPlan,
    render_options,
    resolve_sampling,
    sent_sampling,
)
from gateway.core.structured import format_constraint
from gateway.openai.responses.items import ItemLookup, input_items, to_messages
from gateway.openai.responses.tools import ToolNames, refuse, tool_plan
from gateway.openai.responses.wire import ResponsesRequest
from runtime.types import Constraint, SamplingParams
from templates.types import RenderOptions

log = logging.getLogger(__name__)

INCLUDABLE = frozenset({
    "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
})  # fmt: skip
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")


@dataclass(frozen=True)
class Adapted:
    plan: ChatPlan
    names: ToolNames
    summary: bool  # reasoning.summary asked for a summary
    seal_reasoning: bool  # include has reasoning.encrypted_content
    items: tuple[dict[str, Any], ...]  # this request's input items, as stored


# -- the rest of the request ------------------------------------------------------------


def _check_text(req: ResponsesRequest) -> None:
    verbosity = req.text.verbosity if req.text else None
    if verbosity not in (None, "medium"):
        # Codex sends "low": refusing would break it, and a local model has no trained
        # verbosity switch; the prompt is left as sent rather than edited
        log.info("text.verbosity %r is not applied: this model has no verbosity control", verbosity)


def _check_include(req: ResponsesRequest) -> None:
    for value in req.include or ():
        if value == "message.output_text.logprobs":
            raise refuse(
                "include", "message.output_text.logprobs is not served on /v1/responses yet; "
                "use /v1/chat/completions with logprobs"
            )  # fmt: skip
        if value not in INCLUDABLE:
            log.info("include %r: nothing of that kind is produced here", value)


def text_format(req: ResponsesRequest) -> Constraint | None:
    """text.format: "text", "json_object", or "json_schema" with the schema inline
    ({"type": "json_schema", "name": ..., "schema": {...}, "strict": ...})."""
    fmt = req.text.format if req.text else None
    if fmt is None:
        return None
    return format_constraint(
        fmt.type,
        (fmt.model_extra or {}).get("schema"),
        param="text.format",
        schema_param="text.format.schema",
        kinds=("text", "json_object", "json_schema"),
    )


def refuse_unsupported(req: ResponsesRequest) -> None:
    """Known fields this server cannot honour: a 400 naming each."""
    if req.background:
        raise refuse("background", "background responses are not supported; send it false")
    if req.conversation is not None:
        raise refuse(
            "conversation",
            "this server has no Conversations API; use previous_response_id or send the input",
        )
    if req.prompt is not None:
        raise refuse("prompt", "stored prompt templates are not supported; send input")
    if req.top_logprobs:
        raise refuse("top_logprobs", "logprobs are not served on /v1/responses yet")
    _check_text(req)
    _check_include(req)
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning.effort"
        )


def wants_summary(req: ResponsesRequest) -> bool:
    r = req.reasoning
    return r is not None and (r.summary or r.generate_summary) in SUMMARIES


def _options(req: ResponsesRequest) -> RenderOptions:
    effort = req.reasoning.effort if req.reasoning else None
    # "none" and "minimal" switch thinking off where the template has a switch; any
    # other effort asks for it; no effort leaves the template's default
    thinking = None if effort is None else effort not in ("none", "minimal")
    return render_options(None, effort, enable_thinking=thinking)


def _sampling(req: ResponsesRequest, defaults: Mapping[str, float] | None) -> SamplingParams:
    sent = sent_sampling(req)
    return resolve_sampling(sent, defaults)


def response_plan(
    req: ResponsesRequest,
    *,
    history: Sequence[dict[str, Any]],
    lookup: ItemLookup,
    open_sealed: Callable[[str], str | None],
    tools_supported: bool,
    defaults: Mapping[str, float] | None = None,
) -> Adapted:
    refuse_unsupported(req)
    if isinstance(req.input, list):
        check_count(req.input, MAX_MESSAGES, param="input", what="items")
    items = input_items(req, lookup)
    messages = to_messages(history, items, instructions=req.instructions, open_sealed=open_sealed)
    if not messages:
        raise InvalidRequest("input is empty; send a string or at least one item", param="input")
    tools, names = tool_plan(req, supported=tools_supported)
    plan = ChatPlan(
        messages=messages,
        tools=tools,
        options=_options(req),
        sampling=_sampling(req, defaults),
        max_tokens=req.max_output_tokens,
        stop=(),
        stream=req.stream,
        max_tokens_field="max_output_tokens",
        messages_field="input",
        pin=CachePin(key=req.prompt_cache_key) if req.prompt_cache_key else None,
        constraint=text_format(req),
    )
    stored = tuple(i.model_dump(exclude_none=True, by_alias=True) for i in items)
    include = req.include or ()
    return Adapted(
        plan, names, wants_summary(req), "reasoning.encrypted_content" in include, stored
    )
