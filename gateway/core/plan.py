"""The neutral plan every dialect's adapter builds: messages, tools, sampling, limits.

Nothing here knows a wire format. OpenAI chat, Responses and Anthropic Messages all
become a `ChatPlan`, which `gateway.core.prepare` renders and the engine runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.core.limits import MAX_TOOLS, check_count, check_schema_size, check_stops
from runtime.types import Constraint, SamplingParams
from templates.types import ImagePart, Message, RenderOptions, Tool


@dataclass(frozen=True)
class ToolPlan:
    """Which tools the model sees and how a call is demanded of it."""

    tools: tuple[Tool, ...] = ()  # rendered into the prompt
    schemas: tuple[dict[str, Any], ...] = ()  # OpenAI-shaped, for the output parser
    choice: str = "none"  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for choice "named"
    parallel: bool = True


@dataclass(frozen=True)
class CachePin:
    """A client's request to keep this prompt's prefix cached (Anthropic cache_control,
    OpenAI prompt_cache_key): kept ahead of others in eviction for `ttl` seconds."""

    ttl: float = 300.0
    key: str | None = None


@dataclass(frozen=True)
class ChatPlan:
    messages: tuple[Message, ...]
    tools: ToolPlan
    options: RenderOptions
    sampling: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool = False
    n: int = 1
    max_tokens_field: str = "max_tokens"  # the field the client used, for error messages
    messages_field: str = "messages"  # where the prompt came from, for error messages
    pin: CachePin | None = None
    reasoning_budget: int | None = None  # reasoning tokens before the block is closed
    constraint: Constraint | None = None  # the answer's grammar (a response format's schema)
    prediction: str | None = None  # the text the reply is expected to repeat (drafted from)


@dataclass(frozen=True)
class SamplingFields:
    """Sampling as a client sent it; None = not sent (the model's defaults apply)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0


_SENT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def sent_sampling(req: Any, **extra: Any) -> SamplingFields:
    """The sampling fields a wire request carries under their usual names (absent = None)."""
    sent: dict[str, Any] = {name: getattr(req, name, None) for name in _SENT_FIELDS}
    return SamplingFields(**sent, **extra)


def _pick(sent: float | int | None, default: float | int | None, fallback: float) -> float:
    if sent is not None:
        return float(sent)
    return float(default) if default is not None else fallback


def resolve_sampling(
    fields: SamplingFields, defaults: Mapping[str, float] | None
) -> SamplingParams:
    """What the client sent, else the model's recommended defaults (generation_config),
    else the neutral values (temperature 1, no truncation, no penalty)."""
    d = defaults or {}
    return SamplingParams(
        temperature=_pick(fields.temperature, d.get("temperature"), 1.0),
        top_k=int(_pick(fields.top_k, d.get("top_k"), 0)),
        top_p=_pick(fields.top_p, d.get("top_p"), 1.0),
        min_p=_pick(fields.min_p, d.get("min_p"), 0.0),
        repetition_penalty=_pick(fields.repetition_penalty, d.get("repetition_penalty"), 1.0),
        presence_penalty=_pick(fields.presence_penalty, d.get("presence_penalty"), 0.0),
        frequency_penalty=_pick(fields.frequency_penalty, d.get("frequency_penalty"), 0.0),
        logit_bias=MappingProxyType(dict(fields.logit_bias)),
        seed=fields.seed,
        logprobs=fields.logprobs,
        top_logprobs=fields.top_logprobs,
    )


def has_images(messages: Sequence[Message]) -> bool:
    return any(
        isinstance(m.content, tuple) and any(isinstance(p, ImagePart) for p in m.content)
        for m in messages
    )


def stops(stop: str | Sequence[str] | None, *, param: str = "stop") -> tuple[str, ...]:
    items = [stop] if isinstance(stop, str) else list(stop or ())
    check_stops(items, param=param)
    if any(s == "" for s in items):
        raise InvalidRequest("stop strings must not be empty", param=param)
    return tuple(dict.fromkeys(items))


def render_options(
    kwargs: Mapping[str, Any] | None,
    reasoning_effort: str | None,
    *,
    enable_thinking: bool | None = None,
    add_generation_prompt: bool = True,
) -> RenderOptions:
    """chat_template_kwargs' own enable_thinking wins over the dialect's switch."""
    extra: dict[str, Any] = dict(kwargs or {})
    thinking = extra.pop("enable_thinking", None)
    if thinking is None:
        thinking = enable_thinking
    return RenderOptions(
        add_generation_prompt=add_generation_prompt,
        enable_thinking=None if thinking is None else bool(thinking),
        reasoning_effort=reasoning_effort,
        extra=MappingProxyType(extra),
    )


def tool_plan(
    tools: Sequence[Tool],
    choice: str,
    name: str | None,
    parallel: bool,
    *,
    supported: bool,
    param: str = "tools",
) -> ToolPlan:
    """`choice` is "none", "auto", "required" or "named" (with `name`), already checked
    against the tool names by the dialect's adapter."""
    check_count(tools, MAX_TOOLS, param=param, what="tools")
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise InvalidRequest(
                f"tool names must be unique; {tool.name!r} appears twice", param=param
            )
        seen.add(tool.name)
        check_schema_size(dict(tool.parameters), param=param, what=f"tool {tool.name!r}'s schema")
    if choice == "none" or not tools:
        return ToolPlan()  # tools are neither rendered nor parsed
    if not supported:
        raise InvalidRequest(
            "this model's chat template has no tool-calling format; omit tools or set "
            "tool_choice to 'none'",
            param=param,
        )
    schemas = tuple(
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                "parameters": dict(t.parameters),
            },
        }
        for t in tools
    )
    return ToolPlan(tuple(tools), schemas, choice, name, parallel)
