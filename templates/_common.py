"""Pieces the built-in renderers share: the values an official template would see, in Python.

Each built-in renderer reproduces one family's official jinja template. The template
sees what `templates.hf` gives it (message dicts, OpenAI-shaped tool dicts, variables
from `RenderOptions`); these helpers compute the same values without jinja, so that
the built-in output can equal the template's character for character.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from templates.hf import tool_dicts
from templates.types import (
    ContentPart,
    ImagePart,
    Message,
    RenderOptions,
    TemplateError,
    TextPart,
    Tool,
)


class NotSet(Enum):
    """A template variable nobody set (the template's `is defined` is false)."""

    NOT_SET = "not set"


NOT_SET = NotSet.NOT_SET

# reasoning_effort values that mean "do not think" for models whose thinking is on/off.
_NO_THINKING_EFFORTS = frozenset({"none", "minimal"})


def require_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise TemplateError("the conversation has no messages")


def variable(options: RenderOptions, name: str) -> Any:
    """A template variable as the HF path defines it: `enable_thinking` and
    `reasoning_effort` from the options win over chat_template_kwargs; NOT_SET if absent."""
    if name == "enable_thinking" and options.enable_thinking is not None:
        return options.enable_thinking
    if name == "reasoning_effort" and options.reasoning_effort is not None:
        return options.reasoning_effort
    return options.extra.get(name, NOT_SET)


def thinking_variable(options: RenderOptions, name: str = "enable_thinking") -> Any:
    """The thinking switch a family's template reads under `name`. When neither the
    option nor chat_template_kwargs set it, `reasoning_effort` decides ("none" and
    "minimal" turn thinking off, any other effort turns it on); else NOT_SET, which
    leaves the family's own default."""
    value = variable(options, name)
    if value is not NOT_SET:
        return value
    effort = variable(options, "reasoning_effort")
    if isinstance(effort, str):
        return effort.strip().lower() not in _NO_THINKING_EFFORTS
    return NOT_SET


def text_of(content: str | tuple[ContentPart, ...] | None, family: str) -> str:
    """A message's text. Null content reads as "", as in the HF path's last resort;
    images are refused, since the family's prompt format has no place for them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if any(isinstance(part, ImagePart) for part in content):
        raise TemplateError(
            f"the built-in {family} renderer cannot render images: this model family's "
            "prompt format has no image input"
        )
    return "".join(part.text for part in content if isinstance(part, TextPart))


def tojson(value: Any, *, indent: int | None = None) -> str:
    """`| tojson` in our jinja environment: no ASCII escaping, Python's separators."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def jinja_string(value: Any) -> str:
    """`| string` on a JSON value: Python's str() (so true is "True", null is "None")."""
    return str(value)


def object_arguments(arguments: str) -> dict[str, Any] | None:
    """Tool-call arguments as the template sees them: a dict when the text is a JSON
    object, else None (the template then gets the text itself)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def arguments_text(arguments: str) -> str:
    """`arguments if arguments is string else arguments | tojson` (Qwen, Hermes style):
    a JSON object is re-serialized, anything else is kept verbatim."""
    parsed = object_arguments(arguments)
    return arguments if parsed is None else tojson(parsed)


def arguments_tojson(arguments: str) -> str:
    """`arguments | tojson`: a JSON object re-serialized, any other text as a JSON string."""
    parsed = object_arguments(arguments)
    return tojson(arguments if parsed is None else parsed)


def xml_parameter_value(value: Any) -> str:
    """A parameter value in Qwen's XML call format: objects and arrays as JSON, scalars
    through `| string`."""
    if isinstance(value, (Mapping, list)):
        return tojson(value)
    return jinja_string(value)


def tool_views(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The OpenAI-shaped tool dicts the templates iterate (see `templates.hf`)."""
    return tool_dicts(tools) or []


def split_think(content: str) -> tuple[str, str]:
    """(reasoning, answer) from text holding `<think>...</think>`, trimmed of newlines
    the way the Qwen and GLM templates do it; reasoning is "" when there is no
    `</think>`."""
    if "</think>" not in content:
        return "", content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")
