"""Hermes-style tool calls (Qwen2.5, Qwen3):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Arguments stream as the JSON arrives once the name is known. Several objects inside
one pair of tags are several calls; stray text inside the tags after a call is
dropped; a call that cannot be read is given back as content.

Small models (Qwen2.5-Coder-0.5B among them) often write the call object bare, with
no tags. A reply that *opens* with a JSON object whose only keys are name and
arguments and whose name is a declared tool is read as a call too; anything else in
that object (an ordinary JSON answer) is content.
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
    START = auto()  # nothing but whitespace yet: a bare call object may open the reply
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
        self._state = _H.START
        self._bare = False  # the call being read opened the reply without tags
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
        return self._m_content if self._state in (_H.START, _H.CONTENT) else self._m_tags

    def _start_call(self, raw: str, *, bare: bool = False) -> None:
        self._calls.begin(raw)
        self._scanner = ObjectScanner(CallObjectSink(self._calls, strict_keys=bare))
        self._bare = bare
        self._state = _H.CALL

    def _on_start(self, text: str) -> int:
        body = text.lstrip()
        if not body:
            self._out.content(text)
            return len(text)
        if body.startswith("{"):
            self._out.content(text[: len(text) - len(body)])
            self._start_call(self._out.take_ws(), bare=True)
            return len(text) - len(body)
        self._state = _H.CONTENT
        return 0

    def _on_text(self, text: str) -> int:
        state = self._state
        if state is _H.START:
            return self._on_start(text)
        if state is _H.CONTENT:
            self._out.content(text)
        elif state is _H.CALL:
            used, outcome = feed_call(self._calls, self._scanner, text)
            if outcome is not Outcome.MORE:
                done = outcome is Outcome.REJECTED or self._bare
                self._state = _H.CONTENT if done else _H.AFTER
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
        if self._state is _H.START:
            self._state = _H.CONTENT
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
