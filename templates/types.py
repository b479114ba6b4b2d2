"""Neutral conversation values: what the gateway builds and a renderer turns into prompt text.

Leaf vocabulary: frozen dataclasses importing nothing of ours, so every dialect
(OpenAI chat, Responses, Anthropic) can be converted to the same shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeAlias


def _empty_mapping() -> Mapping[str, Any]:
    return MappingProxyType({})


class TemplateError(ValueError):
    """The conversation cannot be rendered; the message says why (the gateway answers 400)."""


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image in a message; `source` is a URL or a data: URI, opaque to templates."""

    source: str


ContentPart: TypeAlias = TextPart | ImagePart


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made. `arguments` is JSON text, kept verbatim as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    role: str
    content: str | tuple[ContentPart, ...] | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=_empty_mapping)


@dataclass(frozen=True)
class RenderOptions:
    """How to render. `None` means "leave it to the template's own default"."""

    add_generation_prompt: bool = True
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    # chat_template_kwargs from the request, passed to the template as variables
    extra: Mapping[str, Any] = field(default_factory=_empty_mapping)


@dataclass(frozen=True)
class Rendered:
    """A rendered prompt: its text, and the character spans [start, end) of it where a
    control-token string from message content landed; the tokenizer reads those as
    plain text, so only the template's own markup becomes control tokens."""

    text: str
    content: tuple[tuple[int, int], ...] = ()


class Renderer(Protocol):
    """Messages + tools -> prompt text. A pure function of its arguments."""

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str: ...
