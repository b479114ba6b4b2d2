"""The skeleton every tool-call format shares: a marker-scanning state machine
(parsers/_scan.py) that writes content and tool-call events (parsers/_calls.py).

A format says only what differs: its markers per state, what text and markers do in
each state, and what its state still holds when the output ends. Feeding, running
out the held text at the end, and flushing held whitespace are the same for all.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from parsers._calls import Out, ToolCalls
from parsers._scan import Machine
from parsers._schema import ToolSet
from parsers.events import Event


class CallFormat(Machine):
    """A tool-call format: a parser of non-reasoning text (parsers/_compose.py `Format`)."""

    openers: ClassVar[tuple[str, ...]] = ()
    """Markers that start tool-call syntax; inside reasoning they end it."""

    def __init__(self, tools: ToolSet) -> None:
        super().__init__()
        self._out = Out()
        self._calls = ToolCalls(tools, self._out)

    def feed(self, text: str) -> list[Event]:
        self._run(text)
        return self._out.take()

    def finish(self, *, truncated: bool = False) -> list[Event]:
        """The output is over; `truncated`: it stopped at its token limit, so markup left
        unfinished is dropped rather than shown as text."""
        self._calls.truncated = truncated
        held = self._held
        if truncated and held and any(o.startswith(held) for o in self.openers):
            self._held = ""  # a cut-off start of a call opener is markup, not text
        self._run("", final=True)
        self._end_output(truncated)
        self._out.flush()
        return self._out.take()

    @abstractmethod
    def _end_output(self, truncated: bool) -> None:
        """The held text has run out: end the call in progress (valid, or given back as
        content) and release markup held for a call that never came (unless
        `truncated`: then it is dropped)."""
