"""Wire requests -> neutral values: template messages, sampling params, stops.

Every field is either turned into something the runtime honours or refused with
an InvalidRequest naming it; nothing is silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gateway.errors import InvalidRequest
from gateway.protocol import openai as wire
from runtime.types import SamplingParams
from templates.types import ImagePart, Message, RenderOptions, TextPart, Tool, ToolCall

MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class ToolPlan:
    """Which tools the model sees and how a call is demanded of it."""

    tools: tuple[Tool, ...] = ()  # rendered into the prompt
    schemas: tuple[dict[str, Any], ...] = ()  # OpenAI-shaped, for the output parser
    choice: str = "none"  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for choice "named"
    parallel: bool = True


@dataclass(frozen=True)
class ChatPlan:
    messages: tuple[Message, ...]
    tools: ToolPlan
    options: RenderOptions
    sampling: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _content(msg: wire.ChatMessage, index: int) -> str | tuple[TextPart | ImagePart, ...] | None:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    parts: list[TextPart | ImagePart] = []
    for part in msg.content:
        if isinstance(part, wire.TextPart):
            parts.append(TextPart(part.text))
        else:
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            parts.append(ImagePart(url))
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return tuple(parts)


def _tool_calls(msg: wire.ChatMessage, index: int) -> tuple[ToolCall, ...]:
    calls = []
    for j, call in enumerate(msg.tool_calls or ()):
        args = call.function.arguments or "{}"
        try:
            json.loads(args)
        except json.JSONDecodeError:
            raise InvalidRequest(
                f"messages[{index}].tool_calls[{j}].function.arguments is not valid JSON",
                param=f"messages[{index}].tool_calls[{j}].function.arguments",
            ) from None
        calls.append(ToolCall(id=call.id, name=call.function.name, arguments=args))
    return tuple(calls)


def to_messages(messages: list[wire.ChatMessage]) -> tuple[Message, ...]:
    out = []
    for i, msg in enumerate(messages):
        if msg.role == "tool" and not msg.tool_call_id:
            raise InvalidRequest(
                f"messages[{i}] has role 'tool' but no tool_call_id", param=f"messages[{i}].tool_call_id"
            )
        role = "system" if msg.role == "developer" else msg.role
        out.append(
            Message(
                role=role,
                content=_content(msg, i),
                name=msg.name,
                tool_calls=_tool_calls(msg, i),
                tool_call_id=msg.tool_call_id,
                reasoning=msg.reasoning_content or msg.reasoning,
            )
        )
    return tuple(out)


def has_images(messages: tuple[Message, ...]) -> bool:
    return any(
        isinstance(m.content, tuple) and any(isinstance(p, ImagePart) for p in m.content)
        for m in messages
    )


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    if any(s == "" for s in stops):
        raise InvalidRequest("stop strings must not be empty", param="stop")
    return tuple(dict.fromkeys(stops))


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id", param="logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                param="logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise InvalidRequest("logit_bias values must be between -100 and 100", param="logit_bias")
        out[token] = float(value)
    return out


def sampling_params(req: wire.ChatCompletionRequest, vocab_size: int) -> SamplingParams:
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=req.top_k or 0,
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=MappingProxyType(_logit_bias(req.logit_bias, vocab_size)),
        seed=req.seed,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
    )


def _tool_choice(choice: str | dict[str, Any] | None, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"tool_choice {choice!r} is not one of none, auto, required or a named function",
                param="tool_choice",
            )
        if choice == "required" and not names:
            raise InvalidRequest("tool_choice 'required' needs a non-empty tools list", param="tools")
        return (choice if names else "none"), None
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest(
            'a named tool_choice must look like {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return "named", name


def tool_plan(req: wire.ChatCompletionRequest, *, supported: bool) -> ToolPlan:
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param="tools")
    choice, name = _tool_choice(req.tool_choice, set(names))
    if choice == "none":
        return ToolPlan()  # tool_choice none: tools are neither rendered nor parsed
    if not supported:
        raise InvalidRequest(
            "this model's chat template has no tool-calling format; omit tools or set "
            "tool_choice to 'none'",
            param="tools",
        )
    rendered = tuple(
        Tool(t.function.name, t.function.description, MappingProxyType(t.function.parameters or {}))
        for t in tools
    )
    schemas = tuple(t.model_dump(exclude_none=True) for t in tools)
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    return ToolPlan(rendered, schemas, choice, name, parallel)


def _refuse_unsupported(req: wire.ChatCompletionRequest) -> None:
    if req.n not in (None, 1):
        raise InvalidRequest("n > 1 is not supported by this server yet; send n=1", param="n")
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequest(
            f"response_format {req.response_format.type!r} is not supported yet; "
            "only 'text' is honoured",
            param="response_format",
        )
    if req.store:
        raise InvalidRequest("this server does not store completions; send store: false", param="store")


def _options(req: wire.ChatCompletionRequest) -> RenderOptions:
    extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
    thinking = extra.pop("enable_thinking", None)
    return RenderOptions(
        add_generation_prompt=True,
        enable_thinking=None if thinking is None else bool(thinking),
        reasoning_effort=req.reasoning_effort,
        extra=MappingProxyType(extra),
    )


def chat_plan(req: wire.ChatCompletionRequest, *, vocab_size: int, tools_supported: bool) -> ChatPlan:
    _refuse_unsupported(req)
    max_tokens = req.max_completion_tokens or req.max_tokens
    return ChatPlan(
        messages=to_messages(req.messages),
        tools=tool_plan(req, supported=tools_supported),
        options=_options(req),
        sampling=sampling_params(req, vocab_size),
        max_tokens=max_tokens,
        stop=_stops(req.stop),
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )
