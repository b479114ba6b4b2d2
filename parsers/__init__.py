"""Output parsers: model text -> reasoning, content and tool-call events.

Each parser is an incremental state machine registered by name and created with
`create(name, tools=None)`; `feed(text)` and `finish()` return lists of events.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from parsers.events import Event
from parsers.passthrough import PassthroughParser


class Parser(Protocol):
    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


Factory = Callable[[Sequence[Mapping[str, Any]] | None], Parser]


def _registry() -> dict[str, Factory]:
    return {"passthrough": lambda tools: PassthroughParser()}


def names() -> list[str]:
    return sorted(_registry())


def create(name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> Parser:
    factories = _registry()
    if name not in factories:
        raise KeyError(f"unknown parser {name!r}; known: {', '.join(sorted(factories))}")
    return factories[name](tools)
