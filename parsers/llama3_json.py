"""Llama 3.x JSON tool calls: the whole message is the call,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>`, several separated by ";". JSON that opens the
message (or follows the tag) is read as Llama writes calls: any key other than name,
parameters, arguments or type means it is an ordinary JSON answer, given back as
content at once. Later in the message, JSON (bare or in a ```json fence) is a call only
if it is shaped like one, names a declared tool and its arguments check out
(parsers/_fenced.py), as for hermes.
"""

from __future__ import annotations

import re
from enum import Enum, auto

from parsers._call_format import CallFormat
from parsers._fenced import JsonCalls
from parsers._json_call import CallObjectSink, Outcome, end_call, feed_call
from parsers._json_stream import ObjectScanner
from parsers._scan import NO_MARKERS, Markers
from parsers._schema import ToolSet

PYTHON_TAG = "<|python_tag|>"
_SPACE = re.compile(r"\s*")
_GAP = re.compile(r"[\s;]*")


class _LlamaState(Enum):
    START = auto()  # the message (or the text after the tag) has not begun yet
    CALL = auto()
    BETWEEN = auto()  # after a call: ";" or whitespace, then maybe another
    CONTENT = auto()


class Llama3JsonFormat(CallFormat):
    openers = (PYTHON_TAG,)

    def __init__(self, tools: ToolSet) -> None:
        super().__init__(tools)
        self._state = _LlamaState.START
        self._tag = ""  # a python tag (and padding) not yet known to start a call
        self._scanner = self._new_scanner()
        self._json = JsonCalls(self._calls, self._out, (PYTHON_TAG,))
        self._m_tag = Markers(PYTHON_TAG)

    def _new_scanner(self) -> ObjectScanner:
        return ObjectScanner(CallObjectSink(self._calls, strict_keys=True))

    def _end_output(self, truncated: bool) -> None:
        if self._state is _LlamaState.CALL:
            end_call(self._calls, self._scanner)
        elif self._state is _LlamaState.CONTENT:
            self._json.finish()
        if not truncated:
            self._out.content(self._tag)
        self._tag = ""

    def _markers(self) -> Markers:
        if self._state is _LlamaState.CONTENT:
            return self._json.markers()
        return self._m_tag if self._state is _LlamaState.START else NO_MARKERS

    def _on_text(self, text: str) -> int:
        state = self._state
        if state is _LlamaState.CONTENT:
            return self._json.on_text(text)
        if state is _LlamaState.CALL:
            used, outcome = feed_call(self._calls, self._scanner, text)
            if outcome is Outcome.ENDED:
                self._state = _LlamaState.BETWEEN
            elif outcome is Outcome.REJECTED:
                self._state = _LlamaState.CONTENT
                if not (self._scanner.done or self._scanner.failed):
                    self._json.rest(self._scanner)  # a JSON answer is content to its end
            return used
        gap = _GAP if state is _LlamaState.BETWEEN else _SPACE
        hit = gap.match(text)
        lead = hit.end() if hit else 0
        if lead == len(text):
            self._pad(text)
            return lead
        self._pad(text[:lead])
        if text[lead] == "{":
            self._begin()
        else:
            self._to_content()
        return lead

    def _pad(self, text: str) -> None:
        if self._state is _LlamaState.START:
            if self._tag:
                self._tag += text
            else:
                self._out.content(text)  # held back by Out until it is known what follows

    def _begin(self) -> None:
        self._calls.begin(self._out.take_ws() + self._tag)
        self._tag = ""
        self._scanner = self._new_scanner()
        self._state = _LlamaState.CALL

    def _to_content(self) -> None:
        self._out.content(self._tag)
        self._tag = ""
        self._state = _LlamaState.CONTENT

    def _on_marker(self, marker: str) -> None:
        if self._state is _LlamaState.CONTENT and self._json.on_marker(marker):
            return
        self._out.content(self._tag)
        self._tag = self._out.take_ws() + marker
        self._state = _LlamaState.START
