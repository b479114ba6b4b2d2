"""Qwen3-Coder / Qwen3.5 XML tool calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Tolerated: a missing `<tool_call>` opener (models often start with `<function=` right
after reasoning), and missing or mismatched closers: any later tag closes whatever is
still open. String parameters stream as they are written; other parameters are
emitted, coerced to their schema type, when they end. The one newline the template
puts around a value is removed; a value closed by another tag loses its trailing
whitespace.
"""

from __future__ import annotations

from enum import Enum, auto

from parsers._call_format import CallFormat
from parsers._scan import Markers
from parsers._schema import ToolSet, coerce_text, dumps, is_string_only

TC_OPEN, TC_CLOSE = "<tool_call>", "</tool_call>"
FN_OPEN, FN_CLOSE = "<function=", "</function>"
P_OPEN, P_CLOSE = "<parameter=", "</parameter>"
_NAME_MAX = 256


class _QwenState(Enum):
    CONTENT = auto()
    SECTION = auto()  # inside <tool_call>, between functions
    FUNC_NAME = auto()
    CALL = auto()  # inside a function, between parameters
    PARAM_NAME = auto()
    VALUE = auto()


class Qwen3CoderFormat(CallFormat):
    openers = (TC_OPEN, FN_OPEN)

    def __init__(self, tools: ToolSet) -> None:
        super().__init__(tools)
        self._state = _QwenState.CONTENT
        self._section_raw = ""  # "<tool_call>" and padding, until a function starts
        self._name: list[str] = []
        self._name_len = 0
        self._key = ""
        self._value: list[str] | None = None  # None while a string value streams
        self._fresh = False  # no value text yet: the leading newline goes
        self._ws = ""  # trailing whitespace of a streaming value, held back
        in_call = (P_OPEN, P_CLOSE, FN_CLOSE, TC_CLOSE, FN_OPEN, TC_OPEN)
        self._m = {
            _QwenState.CONTENT: Markers(TC_OPEN, FN_OPEN),
            _QwenState.SECTION: Markers(FN_OPEN, TC_CLOSE, TC_OPEN),
            _QwenState.FUNC_NAME: Markers(">"),
            _QwenState.PARAM_NAME: Markers(">"),
            _QwenState.CALL: Markers(*in_call),
            _QwenState.VALUE: Markers(*in_call),
        }

    def _end_output(self, truncated: bool) -> None:
        if self._state is _QwenState.SECTION and self._section_raw and not truncated:
            self._out.content(self._section_raw)
        elif self._state is _QwenState.VALUE:
            self._end_value(exact=False)
        if self._state not in (_QwenState.CONTENT, _QwenState.SECTION):
            self._calls.end()  # a function was begun

    def _markers(self) -> Markers:
        return self._m[self._state]

    def _on_text(self, text: str) -> int:
        state = self._state
        if state is _QwenState.CONTENT:
            self._out.content(text)
        elif state is _QwenState.SECTION:
            return self._section_text(text)
        elif state in (_QwenState.FUNC_NAME, _QwenState.PARAM_NAME):
            return self._name_text(text)
        elif state is _QwenState.CALL:
            self._calls.raw(text)  # padding between parameters
        else:
            self._calls.raw(text)
            self._value_text(text)
        return len(text)

    def _section_text(self, text: str) -> int:
        if text.isspace():
            if self._section_raw:
                self._section_raw += text
            return len(text)
        # Prose inside the tags: this was no tool call after all.
        self._out.content(self._section_raw)
        self._section_raw = ""
        self._state = _QwenState.CONTENT
        return 0

    def _name_text(self, text: str) -> int:
        bad = next((i for i, ch in enumerate(text) if ch in "\n<"), -1)
        if bad < 0 and self._name_len + len(text) <= _NAME_MAX:
            self._calls.raw(text)
            self._name.append(text)
            self._name_len += len(text)
            return len(text)
        used = max(bad, 0)  # not a tag after all: end the call here
        self._calls.raw(text[:used])
        self._end_call()
        self._state = _QwenState.CONTENT
        return used

    def _value_text(self, text: str) -> None:
        if self._fresh:
            self._fresh = False
            text = text[1:] if text.startswith("\n") else text
        if self._value is not None:
            self._value.append(text)
            return
        body = text.rstrip()
        if body:
            self._calls.string_chunk(self._ws + body)
            self._ws = text[len(body) :]
        else:
            self._ws += text

    def _on_marker(self, marker: str) -> None:
        state = self._state
        if state in (_QwenState.FUNC_NAME, _QwenState.PARAM_NAME):  # the marker is ">"
            self._calls.raw(marker)
            name, self._name, self._name_len = "".join(self._name).strip(), [], 0
            if state is _QwenState.FUNC_NAME:
                self._function_named(name)
            else:
                self._start_value(name)
            return
        if state is _QwenState.VALUE:
            self._end_value(exact=marker == P_CLOSE)
        if marker in (P_OPEN, P_CLOSE, FN_CLOSE, TC_CLOSE) and self._calls.active:
            self._calls.raw(marker)
        self._structural(marker)

    def _structural(self, marker: str) -> None:
        in_call = self._state in (_QwenState.CALL, _QwenState.VALUE)
        if marker == P_OPEN and in_call:
            self._state = _QwenState.PARAM_NAME
        elif marker == P_CLOSE and in_call:
            self._state = _QwenState.CALL
        elif marker in (FN_CLOSE, TC_CLOSE):
            ok = self._end_call() if in_call else True
            self._state = _QwenState.SECTION if ok and marker == FN_CLOSE else _QwenState.CONTENT
            self._section_raw = ""
        elif marker == FN_OPEN:
            if in_call:
                self._end_call()
            raw = self._out.take_ws() + self._section_raw + marker
            self._calls.begin(raw)
            self._section_raw, self._state = "", _QwenState.FUNC_NAME
        else:  # TC_OPEN
            if in_call:
                self._end_call()
            if self._state is _QwenState.CONTENT or in_call:
                self._section_raw = self._out.take_ws()
            self._section_raw += marker
            self._state = _QwenState.SECTION

    def _function_named(self, name: str) -> None:
        if name and not any(ch.isspace() for ch in name) and self._calls.set_name(name):
            self._state = _QwenState.CALL
        else:
            self._calls.doom()
            self._calls.reject()
            self._state = _QwenState.CONTENT

    def _start_value(self, key: str) -> None:
        spec = self._calls.spec
        self._key, self._fresh, self._ws = key, True, ""
        if spec is not None and is_string_only(spec.schema(key)):
            self._value = None
            self._calls.begin_string(key)
        else:
            self._value = []
            self._calls.seen(key)
        self._state = _QwenState.VALUE

    def _end_value(self, exact: bool) -> None:
        """Closes the value; `exact` when its own closing tag did (only then does
        trailing whitespace other than the template's newline survive)."""
        if self._value is None:
            ws = self._ws[:-1] if self._ws.endswith("\n") else self._ws
            self._calls.string_chunk(ws if exact else "")
            self._calls.end_string()
        else:
            text = "".join(self._value)
            text = (text[:-1] if text.endswith("\n") else text) if exact else text.rstrip()
            spec = self._calls.spec
            self._calls.member(
                self._key, dumps(coerce_text(text, spec.schema(self._key) if spec else None))
            )
        self._value, self._ws = None, ""
        self._state = _QwenState.CALL

    def _end_call(self) -> bool:
        self._name, self._name_len, self._value = [], 0, None
        return self._calls.end()
