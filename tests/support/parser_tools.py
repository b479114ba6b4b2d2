"""What the parser contract cases are made of: the declared tools and the case type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parsers import ThinkMode


def _tool(name: str, props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    params = {"type": "object", "properties": props, "required": list(required)}
    return {"type": "function", "function": {"name": name, "parameters": params}}


STR = {"type": "string"}
TOOLS: list[dict[str, Any]] = [
    _tool(
        "get_weather",
        {"city": STR, "unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer"}},
        ("city",),
    ),
    _tool(
        "set_flags",
        {
            "enabled": {"type": "boolean"},
            "ratio": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "meta": {"type": "object", "properties": {"n": {"type": "integer"}}},
            "nothing": {"type": "null"},
            "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "count": {"type": ["integer", "null"]},
            "label": STR,
        },
    ),
    _tool("write_file", {"path": STR, "content": STR}, ("path", "content")),
    _tool("get_time", {}),
    _tool("func", {"k": STR, "a": STR, "b": STR, "city": STR, "unit": STR}),
    _tool("get-weather", {"city": STR, "unit": STR}),
    {  # a closed schema, as Claude Code's and OpenClaw's tools have
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"path": STR},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    _tool("sleep", {"seconds": {"type": "integer"}}, ("seconds",)),
]
DECLARED = frozenset(t["function"]["name"] for t in TOOLS)

Call = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    text: str
    content: str = ""
    reasoning: str = ""
    calls: tuple[Call, ...] = ()
    think: ThinkMode | None = None
    tools: list[dict[str, Any]] | None = field(default_factory=lambda: TOOLS)


def W(city: str, **more: Any) -> Call:
    return ("get_weather", {"city": city, **more})
