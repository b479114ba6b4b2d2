"""The parser for models with no reasoning or tool-call syntax: all text is content."""

from __future__ import annotations

from parsers.events import Content, Event


class PassthroughParser:
    def feed(self, text: str) -> list[Event]:
        return [Content(text)] if text else []

    def finish(self, *, truncated: bool = False) -> list[Event]:
        return []
