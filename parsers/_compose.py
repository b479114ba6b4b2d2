"""How reasoning and tool-call parsing compose: a think splitter in front of a
tool-call format. Reasoning text becomes `Reasoning` events; everything else goes to
the format (or becomes `Content` when tool parsing is off)."""

from __future__ import annotations

from typing import Protocol

from parsers._think import ThinkMode, ThinkSplitter
from parsers.events import Content, Event, Reasoning, ToolCallArgs


class Format(Protocol):
    """A tool-call format: a parser of non-reasoning text (each one is built on
    parsers/_call_format.py `CallFormat`)."""

    @property
    def openers(self) -> tuple[str, ...]:
        """Markers that start tool-call syntax; inside reasoning they end it."""
        ...

    def feed(self, text: str) -> list[Event]: ...

    def finish(self, *, truncated: bool = False) -> list[Event]: ...


class ComposedParser:
    def __init__(self, fmt: Format | None, think: ThinkMode) -> None:
        self._fmt = fmt
        self._think = ThinkSplitter(think, fmt.openers if fmt else ())

    def feed(self, text: str) -> list[Event]:
        return self._route(self._think.feed(text), final=False)

    def finish(self, *, truncated: bool = False) -> list[Event]:
        return self._route(self._think.finish(), final=True, truncated=truncated)

    def _route(
        self, segments: list[tuple[bool, str]], final: bool, truncated: bool = False
    ) -> list[Event]:
        events: list[Event] = []
        for is_reasoning, text in segments:
            if is_reasoning:
                events.append(Reasoning(text))
            elif self._fmt is not None:
                events += self._fmt.feed(text)
            else:
                events.append(Content(text))
        if final and self._fmt is not None:
            events += self._fmt.finish(truncated=truncated)
        return coalesce(events)


def coalesce(events: list[Event]) -> list[Event]:
    """Merges neighbouring text events of one kind (and argument fragments of one
    call); drops empty ones. Joins each run once, so the work stays linear."""
    out: list[Event] = []
    run: list[str] = []
    run_key: tuple[type, int] | None = None
    for ev in events:
        key: tuple[type, int]
        if isinstance(ev, (Content, Reasoning)):
            key, text = (type(ev), -1), ev.text
        elif isinstance(ev, ToolCallArgs):
            key, text = (ToolCallArgs, ev.index), ev.fragment
        else:
            _close_run(out, run, run_key)
            run, run_key = [], None
            out.append(ev)
            continue
        if not text:
            continue
        if key != run_key:
            _close_run(out, run, run_key)
            run, run_key = [], key
        run.append(text)
    _close_run(out, run, run_key)
    return out


def _close_run(out: list[Event], run: list[str], key: tuple[type, int] | None) -> None:
    if not run or key is None:
        return
    text = "".join(run)
    if key[0] is ToolCallArgs:
        out.append(ToolCallArgs(key[1], text))
    elif key[0] is Reasoning:
        out.append(Reasoning(text))
    else:
        out.append(Content(text))
