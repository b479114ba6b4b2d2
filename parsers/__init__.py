"""Output parsers: model text -> reasoning, content and tool-call events.

Each parser is an incremental state machine registered by name and created with
`create(name, tools=None, think=None)`; `feed(text)` and `finish(truncated=False)`
return lists of events (parsers/events.py).

Composition: every parser but `passthrough` is a `<think>` splitter in front of a
tool-call format (parsers/_compose.py), the format named by parsers/registry.py.
`think` picks how reasoning is read: False: none; True (the default): only if the
output opens with `<think>`; "open": the prompt ended inside an open `<think>`, so
the output starts in reasoning (see `think_mode`). A tool-call opener inside reasoning ends it. With no tools declared
(tools None or empty, as for tool_choice "none"), tool-call syntax is plain content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from parsers._compose import ComposedParser
from parsers._schema import ToolSet
from parsers._think import ThinkMode
from parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart
from parsers.passthrough import PassthroughParser
from parsers.registry import PASSTHROUGH, formats, names

__all__ = [
    "Content",
    "Event",
    "Parser",
    "Reasoning",
    "ThinkMode",
    "ToolCallArgs",
    "ToolCallEnd",
    "ToolCallStart",
    "create",
    "names",
    "think_mode",
]


class Parser(Protocol):
    def feed(self, text: str) -> list[Event]: ...
    def finish(self, *, truncated: bool = False) -> list[Event]:
        """The output is over; `truncated`: it stopped at its token limit, so tool-call
        markup left unfinished is dropped rather than shown as text."""
        ...


def create(
    name: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    think: ThinkMode | None = None,
) -> Parser:
    """A fresh parser for one response. `tools` are OpenAI-shaped tool dicts."""
    if think is not None and think not in (True, False, "open"):
        raise ValueError(f"think must be True, False or 'open', not {think!r}")
    if name == PASSTHROUGH:
        return PassthroughParser()
    known = formats()
    if name not in known:
        raise KeyError(f"unknown parser {name!r}; known: {', '.join(names())}")
    factory = known[name]
    toolset = ToolSet.from_openai(tools)
    fmt = factory(toolset) if factory is not None and toolset else None
    return ComposedParser(fmt, True if think is None else think)


def think_mode(prompt: str, open_tag: str = "<think>") -> ThinkMode:
    """The `think` option for a rendered prompt: "open" when it ends inside an open
    think tag (the model's output then starts in reasoning), else True."""
    return "open" if prompt.rstrip().endswith(open_tag) else True
