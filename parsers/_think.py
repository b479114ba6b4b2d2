"""Splitting `<think>` reasoning from the rest of the text.

Modes: False (no reasoning), True (reasoning only if the output opens with the think
tag), "open" (the prompt ended inside an open think tag, so the output starts in
reasoning). Reasoning ends at the close tag, or implicitly at a tool-call opener (the
opener and all after it go on as non-reasoning text). Whitespace padding around
reasoning is dropped, as chat templates strip it when they render it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, auto
from typing import Literal

from parsers._scan import NO_MARKERS, Machine, Markers

ThinkMode = bool | Literal["open"]


class _ThinkState(Enum):
    DETECT = auto()  # has the output opened with the think tag?
    REASONING = auto()
    CONTENT_START = auto()  # just after the close tag: skip padding
    CONTENT = auto()


class ThinkSplitter(Machine):
    """Text in, (is_reasoning, text) segments out."""

    def __init__(
        self,
        mode: ThinkMode,
        handoff: Sequence[str] = (),
        open_tag: str = "<think>",
        close_tag: str = "</think>",
    ) -> None:
        super().__init__()
        self._segments: list[tuple[bool, str]] = []
        self._open, self._close = open_tag, close_tag
        if mode == "open":
            self._state = _ThinkState.REASONING
        else:
            self._state = _ThinkState.DETECT if mode else _ThinkState.CONTENT
        self._fresh = True  # no reasoning text yet: padding and a repeated open tag go
        self._lead = ""  # whitespace before the open tag
        self._ws = ""  # trailing whitespace of reasoning, held back
        self._m_detect = Markers(open_tag)
        self._m_fresh = Markers(close_tag, open_tag, *handoff)
        self._m_reasoning = Markers(close_tag, *handoff)

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self._run(text)
        return self._take()

    def finish(self) -> list[tuple[bool, str]]:
        self._run("", final=True)
        if self._lead:
            self._segments.append((False, self._lead))
            self._lead = ""
        self._ws = ""
        return self._take()

    def _take(self) -> list[tuple[bool, str]]:
        out, self._segments = self._segments, []
        return out

    def _markers(self) -> Markers:
        if self._state is _ThinkState.DETECT:
            return self._m_detect
        if self._state is _ThinkState.REASONING:
            return self._m_fresh if self._fresh else self._m_reasoning
        return NO_MARKERS

    def _on_text(self, text: str) -> int:
        state, used = self._state, len(text)
        if state is _ThinkState.DETECT:
            if text.isspace():
                self._lead += text
                return used
            self._state = _ThinkState.CONTENT  # no think tag first: all of it is content
            return 0
        if state is _ThinkState.REASONING:
            self._reasoning(text)
        elif state is _ThinkState.CONTENT_START:
            text = text.lstrip()
            if text:
                self._state = _ThinkState.CONTENT
                self._segments.append((False, text))
        else:
            if self._lead:
                text, self._lead = self._lead + text, ""
            self._segments.append((False, text))
        return used

    def _reasoning(self, text: str) -> None:
        if self._fresh:
            text = text.lstrip()
            if not text:
                return
            self._fresh = False
        body = text.rstrip()
        if body:
            self._segments.append((True, self._ws + body))
            self._ws = text[len(body) :]
        else:
            self._ws += text

    def _on_marker(self, marker: str) -> None:
        if self._state is _ThinkState.DETECT:
            self._state, self._lead = _ThinkState.REASONING, ""
        elif marker == self._close:
            self._state, self._ws = _ThinkState.CONTENT_START, ""
        elif marker != self._open:  # a tool-call opener ends reasoning
            self._state, self._ws = _ThinkState.CONTENT, ""
            self._segments.append((False, marker))
