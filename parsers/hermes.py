"""Hermes-style tool calls (Qwen2.5, Qwen3):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Arguments stream as the JSON arrives once the name is known. Several objects inside
one pair of tags are several calls; stray text inside the tags after a call is
dropped; a call that cannot be read is given back as content.
"""

from __future__ import annotations

from enum import Enum, auto

from parsers._calls import Out, ToolCalls
from parsers._json_call import CallObjectSink, Outcome, end_call, feed_call
from parsers._json_stream import ObjectScanner
from parsers._scan import Machine, Markers
from parsers._schema import ToolSet
from parsers.events import Event

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class _H(Enum):
    CONTENT = auto()
    CALL = auto()  # reading a call object
    AFTER = auto()  # inside the tags, after a call object
    SKIP = auto()  # inside the tags, after stray text


class HermesFormat(Machine):
    openers = (OPEN,)

    def __init__(self, tools: ToolSet) -> None:
        super().__init__()
        self._out = Out()
        self._calls = ToolCalls(tools, self._out)
        self._state = _H.CONTENT
        self._scanner = ObjectScanner(CallObjectSink(self._calls))
        self._m_content = Markers(OPEN)
        self._m_tags = Markers(OPEN, CLOSE)

    def feed(self, text: str) -> list[Event]:
        self._run(text)
        return self._out.take()

    def finish(self) -> list[Event]:
        self._run("", final=True)
        if self._state is _H.CALL:
            end_call(self._calls, self._scanner)
        self._out.flush()
        return self._out.take()

    def _markers(self) -> Markers:
        return self._m_content if self._state is _H.CONTENT else self._m_tags

    def _start_call(self, raw: str) -> None:
        self._calls.begin(raw)
        self._scanner = ObjectScanner(CallObjectSink(self._calls))
        self._state = _H.CALL

    def _on_text(self, text: str) -> int:
        state = self._state
        if state is _H.CONTENT:
            self._out.content(text)
        elif state is _H.CALL:
            used, outcome = feed_call(self._calls, self._scanner, text)
            if outcome is not Outcome.MORE:
                self._state = _H.CONTENT if outcome is Outcome.REJECTED else _H.AFTER
            return used
        elif state is _H.AFTER:
            body = text.lstrip()
            if body.startswith("{"):
                self._start_call("")
                return len(text) - len(body)
            if body:
                self._state = _H.SKIP
        return len(text)

    def _on_marker(self, marker: str) -> None:
        if self._state is _H.CALL:
            if marker == CLOSE:
                self._calls.raw(marker)
            end_call(self._calls, self._scanner)
            self._state = _H.CONTENT
            if marker == CLOSE:
                return
        if marker == OPEN:
            self._start_call(self._out.take_ws() + marker)
        else:
            self._state = _H.CONTENT
