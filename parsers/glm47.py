"""GLM-4.5 / 4.6 / 4.7 XML tool calls:

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>

(4.5 and 4.6 put newlines between the parts.) GLM models often leave tags out, so the
arguments are read as the repeating cycle <arg_key> </arg_key> <arg_value>
</arg_value>: when a tag other than the expected one comes, the missing tags are
assumed, and text where an opening tag was expected becomes that element's content.
The function name ends at the first tag, or at the first whitespace when the first
tag is not <arg_key> ("get_weather city</arg_key>..."). Whitespace next to an
assumed tag is padding and is dropped; values are coerced to their schema type and
emitted as each one ends. Also read: the older `name\n{json}` form.
"""

from __future__ import annotations

from enum import Enum, auto

from parsers._call_format import CallFormat
from parsers._scan import Markers
from parsers._schema import ToolSet, coerce_text, coerce_value, dumps, loads

TC_OPEN, TC_CLOSE = "<tool_call>", "</tool_call>"
CYCLE = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
KEY_OPEN, KEY_CLOSE, VAL_OPEN, VAL_CLOSE = range(4)  # phase: the tag expected next
_NAME_MAX = 1024


class _GlmState(Enum):
    CONTENT = auto()
    NAME = auto()
    ARGS = auto()


class Glm47Format(CallFormat):
    openers = (TC_OPEN,)

    def __init__(self, tools: ToolSet) -> None:
        super().__init__(tools)
        self._state = _GlmState.CONTENT
        self._text: list[str] = []  # text since the last tag
        self._text_len = 0
        self._phase = KEY_OPEN
        self._body = ""  # content of the open element so far
        self._synth_open = False  # the open element's opening tag was assumed
        self._key = ""
        self._m_content = Markers(TC_OPEN)
        self._m_call = Markers(TC_OPEN, TC_CLOSE, *CYCLE)

    def _end_output(self, truncated: bool) -> None:
        if self._state is not _GlmState.CONTENT:
            self._end_call()

    def _markers(self) -> Markers:
        return self._m_content if self._state is _GlmState.CONTENT else self._m_call

    def _on_text(self, text: str) -> int:
        if self._state is _GlmState.CONTENT:
            self._out.content(text)
            return len(text)
        self._calls.raw(text)
        self._text.append(text)
        self._text_len += len(text)
        if self._state is _GlmState.NAME and self._text_len > _NAME_MAX:
            self._calls.reject()  # no tag in sight: this was not a tool call
            self._state = _GlmState.CONTENT
            self._take_text()
        return len(text)

    def _on_marker(self, marker: str) -> None:
        if self._state is _GlmState.CONTENT or marker == TC_OPEN:
            if self._state is not _GlmState.CONTENT:
                self._end_call()
            self._calls.begin(self._out.take_ws() + marker)
            self._state, self._phase, self._body = _GlmState.NAME, KEY_OPEN, ""
            self._take_text()
            return
        self._calls.raw(marker)
        if marker == TC_CLOSE:
            self._end_call()
            return
        tag = CYCLE.index(marker)
        if self._state is _GlmState.NAME and not self._named(tag):
            return
        self._tag(tag)

    def _take_text(self) -> str:
        text, self._text, self._text_len = "".join(self._text), [], 0
        return text

    def _named(self, tag: int) -> bool:
        """At the first tag: the name, and maybe the start of a key without its tag."""
        prefix = self._take_text()
        name = prefix.strip()
        if tag != KEY_OPEN:
            head = prefix.lstrip()
            cut = next((i for i, ch in enumerate(head) if ch.isspace()), -1)
            if cut >= 0:
                name, self._body = head[:cut], head[cut:].lstrip()
                self._phase, self._synth_open = KEY_CLOSE, True
        self._state = _GlmState.ARGS
        if not self._calls.set_name(name):
            self._calls.reject()
            self._state = _GlmState.CONTENT
            return False
        return True

    def _tag(self, found: int) -> None:
        """One tag of the cycle, with the text before it (see the module docstring)."""
        text = self._take_text()
        if self._phase % 2 == 0:
            if found == self._phase:
                self._open(synth=False)  # text before an expected opener is padding
                return
            if text:
                self._open(synth=True)
                self._body, text = text, ""
        while self._phase != found:
            if self._phase % 2 == 0:
                self._open(synth=True)
            else:
                if (self._phase + 1) % 4 == found and text:
                    self._body, text = self._body + text, ""
                self._close(synth=True)
        if found % 2 == 0:
            self._open(synth=False)
        else:
            self._body += text
            self._close(synth=False)

    def _open(self, synth: bool) -> None:
        self._body, self._synth_open = "", synth
        self._phase = (self._phase + 1) % 4

    def _close(self, synth: bool) -> None:
        body, self._body = self._body, ""
        if self._phase == KEY_CLOSE:
            self._key = body.strip()
            if self._key:
                self._calls.seen(self._key)
        else:
            if self._synth_open:
                body = body.lstrip()
            if synth:
                body = body.rstrip()
            self._member(self._key, body)
            self._key = ""
        self._phase = (self._phase + 1) % 4

    def _member(self, key: str, text: str) -> None:
        if not key:
            return  # a value without a key cannot be an argument
        spec = self._calls.spec
        value = coerce_text(text, spec.schema(key) if spec else None)
        self._calls.member(key, dumps(value))

    def _end_call(self) -> None:
        """The call's text is over: close what is open, then emit or give back."""
        if self._state is _GlmState.NAME:
            self._end_unnamed()
        elif self._state is _GlmState.ARGS:
            self._close_open_parts()
        self._calls.end()
        self._state, self._phase, self._body = _GlmState.CONTENT, KEY_OPEN, ""
        self._take_text()

    def _close_open_parts(self) -> None:
        text = self._take_text()
        if self._phase == KEY_CLOSE:
            self._body += text
            self._close(synth=True)
            text = ""
        if self._phase == VAL_OPEN:
            if not text.strip():
                self._member(self._key, "")  # a key with no value: an empty one
                self._key, self._phase = "", KEY_OPEN
                return
            self._open(synth=True)  # a value written with no tags at all
        if self._phase == VAL_CLOSE:
            self._body += text
            self._close(synth=True)

    def _end_unnamed(self) -> None:
        """A call with no tags: just a name, or the older `name\\n{json}` form."""
        head, _, rest = self._take_text().strip().partition("\n")
        if not self._calls.set_name(head):
            return
        rest = rest.strip()
        if rest.startswith("{"):
            try:
                args = loads(rest)
            except (ValueError, RecursionError):
                self._calls.doom()
                return
            if isinstance(args, dict):
                spec = self._calls.spec
                for key, value in args.items():
                    schema = spec.schema(key) if spec else None
                    self._calls.member(key, dumps(coerce_value(value, schema)))
        elif rest:
            self._calls.doom()
