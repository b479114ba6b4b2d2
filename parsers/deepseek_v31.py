"""DeepSeek V3.1 tool calls (reasoning: `</think>`, see parsers/_think.py):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Also read: the DeepSeek V3 form, `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`,
and a call begun without the `tool▁calls▁begin` marker. Arguments stream as the JSON
arrives.
"""

from __future__ import annotations

from enum import Enum, auto

from parsers._call_format import CallFormat
from parsers._json_call import ArgsSink, Outcome, end_call, feed_call
from parsers._json_stream import ObjectScanner
from parsers._scan import Markers
from parsers._schema import ToolSet

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_NAME_MAX = 256


class _DeepSeekState(Enum):
    CONTENT = auto()
    SECTION = auto()  # between calls
    NAME = auto()
    V3_NAME = auto()  # "function<sep>" was read: the name runs to the newline
    ARGS = auto()
    AFTER = auto()  # the arguments object has ended; wait for the call's end


class DeepSeekV31Format(CallFormat):
    openers = (CALLS_BEGIN, CALL_BEGIN)

    def __init__(self, tools: ToolSet) -> None:
        super().__init__(tools)
        self._state = _DeepSeekState.CONTENT
        self._section_raw = ""
        self._name: list[str] = []
        self._name_len = 0  # bounds the name: a runaway one is no call
        self._scanner = ObjectScanner(ArgsSink(self._calls), skip_prefix=True)
        in_call = (CALL_END, CALLS_END, CALL_BEGIN)
        self._m = {
            _DeepSeekState.CONTENT: Markers(CALLS_BEGIN, CALL_BEGIN),
            _DeepSeekState.SECTION: Markers(CALL_BEGIN, CALLS_END, CALLS_BEGIN),
            _DeepSeekState.NAME: Markers(SEP, *in_call),
            _DeepSeekState.V3_NAME: Markers(*in_call),
            _DeepSeekState.ARGS: Markers(*in_call),
            _DeepSeekState.AFTER: Markers(*in_call),
        }

    def _end_output(self, truncated: bool) -> None:
        if self._state is _DeepSeekState.SECTION:
            if not truncated:
                self._out.content(self._section_raw)
        elif self._state is not _DeepSeekState.CONTENT:
            self._end_call()

    def _markers(self) -> Markers:
        return self._m[self._state]

    def _on_text(self, text: str) -> int:
        state = self._state
        if state is _DeepSeekState.CONTENT:
            self._out.content(text)
        elif state is _DeepSeekState.SECTION:
            if not text.isspace():
                self._out.content(self._section_raw)  # prose: the section was no call
                self._section_raw, self._state = "", _DeepSeekState.CONTENT
                return 0
            if self._section_raw:
                self._section_raw += text
        elif state is _DeepSeekState.ARGS:
            used, outcome = feed_call(self._calls, self._scanner, text)
            if outcome is not Outcome.MORE:
                self._state = (
                    _DeepSeekState.AFTER if outcome is Outcome.ENDED else _DeepSeekState.CONTENT
                )
            return used
        elif state is _DeepSeekState.V3_NAME:
            return self._v3_name(text)
        else:
            self._calls.raw(text)
            if state is _DeepSeekState.NAME:
                self._name.append(text)
                self._name_len += len(text)
                if self._name_len > _NAME_MAX:
                    self._calls.reject()
                    self._state, self._name, self._name_len = _DeepSeekState.CONTENT, [], 0
        return len(text)

    def _v3_name(self, text: str) -> int:
        end = text.find("\n")
        used = len(text) if end < 0 else end + 1
        self._calls.raw(text[:used])
        self._name.append(text[:used])
        self._name_len += used
        if end >= 0:
            self._named("".join(self._name))
        elif self._name_len > _NAME_MAX:
            self._named("")  # no newline in sight: not a name
        return used

    def _named(self, name: str) -> None:
        self._name, self._name_len = [], 0
        if self._calls.set_name(name):
            self._scanner = ObjectScanner(ArgsSink(self._calls), skip_prefix=True)
            self._state = _DeepSeekState.ARGS
        else:
            self._calls.reject()
            self._state = _DeepSeekState.CONTENT

    def _on_marker(self, marker: str) -> None:
        state = self._state
        if state is _DeepSeekState.CONTENT or (
            state is _DeepSeekState.SECTION and marker == CALL_BEGIN
        ):
            if marker == CALL_BEGIN:
                self._calls.begin(self._out.take_ws() + self._section_raw + marker)
                self._section_raw, self._state = "", _DeepSeekState.NAME
            else:
                self._section_raw, self._state = (
                    self._out.take_ws() + marker,
                    _DeepSeekState.SECTION,
                )
        elif state is _DeepSeekState.SECTION:
            if marker == CALLS_BEGIN:
                self._section_raw += marker
            else:
                self._section_raw, self._state = "", _DeepSeekState.CONTENT
        elif marker == SEP:
            self._calls.raw(marker)
            name = "".join(self._name).strip()
            if name == "function" and self._calls.tools.get(name) is None:
                self._name, self._name_len, self._state = [], 0, _DeepSeekState.V3_NAME
            else:
                self._named(name)
        else:
            self._call_marker(marker)

    def _call_marker(self, marker: str) -> None:
        """A call-level marker inside a call: it ends the call."""
        if marker != CALL_BEGIN:
            self._calls.raw(marker)
        ok = self._end_call()
        if marker == CALL_BEGIN:
            self._calls.begin(self._out.take_ws() + marker)
            self._state = _DeepSeekState.NAME
        elif marker == CALL_END and ok:
            self._state = _DeepSeekState.SECTION
        else:
            self._state = _DeepSeekState.CONTENT

    def _end_call(self) -> bool:
        state, self._state, self._name, self._name_len = self._state, _DeepSeekState.CONTENT, [], 0
        if state is _DeepSeekState.AFTER:
            return True
        if state is _DeepSeekState.ARGS:
            return end_call(self._calls, self._scanner) is Outcome.ENDED
        return self._calls.end()
