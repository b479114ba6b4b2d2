"""Hermes-style tool calls (Qwen2.5, Qwen3):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Arguments stream as the JSON arrives once the name is known. Several objects inside
one pair of tags are several calls; stray text inside the tags after a call is
dropped; a call that cannot be read is given back as content.

Small models (Qwen2.5-Coder-0.5B among them) often leave the tags out and write the
call object bare or in a ```json fence, at the start of the reply or after a
sentence. Outside the tags such JSON is a call only if it is shaped like one, names a
declared tool and its arguments check out (parsers/_fenced.py); anything else stays
content as written.
"""

from __future__ import annotations

from enum import Enum, auto

from parsers._call_format import CallFormat
from parsers._fenced import JsonCalls
from parsers._json_call import CallObjectSink, Outcome, end_call, feed_call
from parsers._json_stream import ObjectScanner
from parsers._scan import Markers
from parsers._schema import ToolSet

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class _HermesState(Enum):
    CONTENT = auto()  # outside the tags: untagged JSON calls are looked for here
    CALL = auto()  # reading a call object inside the tags
    AFTER = auto()  # inside the tags, after a call object
    SKIP = auto()  # inside the tags, after stray text


class HermesFormat(CallFormat):
    openers = (OPEN,)

    def __init__(self, tools: ToolSet) -> None:
        super().__init__(tools)
        self._state = _HermesState.CONTENT
        self._json = JsonCalls(self._calls, self._out, (OPEN,))
        self._scanner = ObjectScanner(CallObjectSink(self._calls))
        self._m_tags = Markers(OPEN, CLOSE)

    def _end_output(self, truncated: bool) -> None:
        if self._state is _HermesState.CALL:
            end_call(self._calls, self._scanner)
        elif self._state is _HermesState.CONTENT:
            self._json.finish()

    def _markers(self) -> Markers:
        return self._json.markers() if self._state is _HermesState.CONTENT else self._m_tags

    def _start_call(self, raw: str) -> None:
        self._calls.begin(raw)
        self._scanner = ObjectScanner(CallObjectSink(self._calls))
        self._state = _HermesState.CALL

    def _on_text(self, text: str) -> int:
        state = self._state
        if state is _HermesState.CONTENT:
            return self._json.on_text(text)
        if state is _HermesState.CALL:
            used, outcome = feed_call(self._calls, self._scanner, text)
            if outcome is Outcome.ENDED:
                self._state = _HermesState.AFTER
            elif outcome is Outcome.REJECTED:
                self._state = _HermesState.CONTENT
                scanner = self._scanner
                if not (scanner.done or scanner.failed):
                    self._json.rest(scanner)  # nothing inside it is read as a call
            return used
        if state is _HermesState.AFTER:
            body = text.lstrip()
            if body.startswith("{"):
                self._start_call("")
                return len(text) - len(body)
            if body:
                self._state = _HermesState.SKIP
        return len(text)

    def _on_marker(self, marker: str) -> None:
        state = self._state
        if state is _HermesState.CONTENT and self._json.on_marker(marker):
            return
        if state is _HermesState.CALL:
            if marker == CLOSE:
                self._calls.raw(marker)
            end_call(self._calls, self._scanner)
            self._state = _HermesState.CONTENT
            if marker == CLOSE:
                return
        if marker == OPEN:
            self._start_call(self._out.take_ws() + marker)
        else:
            self._state = _HermesState.CONTENT
