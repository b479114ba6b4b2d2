"""Tool calls written as plain JSON instead of the format's own markup, as small models
write them (Qwen2.5-Coder-0.5B answers most tool requests this way):

    Let's proceed.

    ```json
    {"name": "read_file", "arguments": {"path": "hello.txt"}}
    ```

A JSON object, bare anywhere in the content or alone in a ```json, ```tool_call,
```tool_code or plain ``` fence, or a JSON list of such objects, is a call when it is
shaped like one ({"name", "arguments" | "parameters"}, optionally with "type":
"function", or {"type": "function", "function": {...}}), names a declared tool, and its
arguments fit the tool's schema after coercion (parsers/_json_call.py, guess mode).
Anything else is content, exactly as written; a code fence in another language is
content to its end, calls and all.

Held text is released the moment it cannot become a call: a fence whose language is
not one of those above, a body that does not open with "{" or "[", a first key other
than name, function or type, a name that no declared tool's name starts with. A JSON
value that turns out not to be a call is content to its end (so nothing inside it is
read as a call either).

The host format owns the marker scanning (parsers/_scan.py) and hands this class its
content state: `markers`, `on_text` and `on_marker` in that state, `finish` at the end.
"""

from __future__ import annotations

from enum import Enum, auto

from parsers._calls import Out, ToolCalls
from parsers._json_call import CallObjectSink, Outcome, end_call, feed_call
from parsers._json_stream import ObjectScanner
from parsers._scan import NO_MARKERS, Markers

FENCE = "```"
_CALL_LANGS = ("json", "tool_call", "tool_code", "")  # fences a call may be written in
_LANG_MAX = max(len(lang) for lang in _CALL_LANGS) + 8  # room for padding spaces


class _FencedState(Enum):
    IDLE = auto()  # content
    INFO = auto()  # after a fence's backticks: its language
    BODY = auto()  # after the fence's first line: padding, then "{" or "["?
    LIST = auto()  # after "[": padding, then "{"?
    OBJECT = auto()  # reading a call object
    REST = auto()  # the rest of a JSON object that is not a call: content
    LIST_NEXT = auto()  # after a call in a list: "," or "]"
    LIST_ITEM = auto()  # after "," in a list: "{"?
    FENCE_END = auto()  # after the call(s) in a fence: its closing backticks
    CODE = auto()  # inside a fence that is not a call: content up to its close


class JsonCalls:
    """The content state of a host format, with untagged JSON calls recognised."""

    def __init__(self, calls: ToolCalls, out: Out, host_openers: tuple[str, ...]) -> None:
        self._calls = calls
        self._out = out
        self._host = frozenset(host_openers)
        self._state = _FencedState.IDLE
        self._raw: list[str] = []  # held text, content again if no call comes of it
        self._info = ""
        self._fenced = False  # the current JSON sits in a fence
        self._hide_close = False  # the fence's opener went with a call: its closer goes too
        self._in_list = False
        self._scanner = self._new_scanner()
        self._m_idle = Markers(*host_openers, FENCE, "{", "[")
        self._m_code = Markers(*host_openers, FENCE)
        self._m_fence = Markers(FENCE)

    def _new_scanner(self) -> ObjectScanner:
        return ObjectScanner(CallObjectSink(self._calls, guess=True))

    def markers(self) -> Markers:
        state = self._state
        if state is _FencedState.IDLE:
            return self._m_idle
        if state is _FencedState.CODE:
            return self._m_code
        return self._m_fence if state is _FencedState.FENCE_END else NO_MARKERS

    def rest(self, scanner: ObjectScanner) -> None:
        """The host rejected a call while its scan is still inside the object: the
        rest of the object is content."""
        self._scanner, self._fenced, self._in_list = scanner, False, False
        self._state = _FencedState.REST

    def on_marker(self, marker: str) -> bool:
        """False: the marker is the host's (one of its openers); this state is left."""
        state = self._state
        if marker in self._host:
            self._state = _FencedState.IDLE
            return False
        if state is _FencedState.IDLE:
            self._raw = [self._out.take_ws()]
            self._fenced = self._hide_close = self._in_list = False
            if marker == "{":
                self._begin_object()
                self._object(marker)
                return True
            self._raw.append(marker)
            if marker == FENCE:
                self._fenced, self._info, self._state = True, "", _FencedState.INFO
            else:
                self._in_list, self._state = True, _FencedState.LIST
        elif state is _FencedState.CODE:
            if not self._hide_close:
                self._out.content(marker)
            self._state = _FencedState.IDLE
        elif state is _FencedState.FENCE_END:
            self._state = _FencedState.IDLE  # the closing fence of a call: markup
        return True

    def on_text(self, text: str) -> int:
        state = self._state
        if state in (_FencedState.IDLE, _FencedState.CODE):
            self._out.content(text)
            return len(text)
        if state is _FencedState.INFO:
            return self._fence_info(text)
        if state is _FencedState.OBJECT:
            return self._object(text)
        if state is _FencedState.REST:
            used = self._scanner.feed(text)
            self._out.content(text[:used])
            if self._scanner.done or self._scanner.failed:
                self._not_a_call()
            return used
        return self._between(text)

    def finish(self) -> None:
        """The end of the output: a call in progress ends if it is valid (one that has
        started is closed where it stands); held text is content."""
        if self._state is _FencedState.OBJECT:
            end_call(self._calls, self._scanner)
        elif self._state is _FencedState.REST:
            self._scanner.finish()
        else:
            self._release()
        self._raw, self._state = [], _FencedState.IDLE

    def _release(self) -> None:
        self._out.content("".join(self._raw))
        self._raw = []

    def _fence_info(self, text: str) -> int:
        end = text.find("\n")
        line = text if end < 0 else text[:end]
        for i, ch in enumerate(line):  # stops within _LANG_MAX characters
            info = self._info + ch
            lang = info.strip().lower()
            if len(info) > _LANG_MAX or not any(c.startswith(lang) for c in _CALL_LANGS):
                return self._code_fence(line[:i])  # the character is read again as code
            self._info = info
        if end < 0:
            self._raw.append(text)
            return len(text)
        if self._info.strip().lower() not in _CALL_LANGS:
            return self._code_fence(line)
        self._raw.append(text[: end + 1])
        self._state = _FencedState.BODY
        return end + 1

    def _code_fence(self, text: str) -> int:
        """The fence holds code, not a call: it is content up to its close."""
        self._raw.append(text)
        self._release()
        self._state = _FencedState.CODE
        return len(text)

    def _between(self, text: str) -> int:
        """The padding-then-one-character states: what may follow decides."""
        body = text.lstrip()
        lead = len(text) - len(body)
        state = self._state
        if state is not _FencedState.FENCE_END:
            self._raw.append(text[:lead])  # padding around markup that is dropped after a call
        if not body:
            return lead
        ch = body[0]
        if (
            state
            in (
                _FencedState.BODY,
                _FencedState.LIST,
                _FencedState.LIST_ITEM,
                _FencedState.FENCE_END,
            )
            and ch == "{"
        ):
            self._begin_object()
            return lead
        if state is _FencedState.BODY and ch == "[":
            self._raw.append(ch)
            self._in_list, self._state = True, _FencedState.LIST
            return lead + 1
        if state is _FencedState.LIST_NEXT and ch in ",]":
            if ch == ",":
                self._raw, self._state = [ch], _FencedState.LIST_ITEM
            else:
                self._raw, self._in_list = [], False
                self._state = _FencedState.FENCE_END if self._fenced else _FencedState.IDLE
            return lead + 1
        # Anything else: this is not (or no longer) call syntax; the held text is content
        # and the character is read again as content.
        self._release()
        self._not_a_call()
        return lead

    def _begin_object(self) -> None:
        self._calls.begin("".join(self._raw), gated=True)
        self._raw = []
        self._scanner = self._new_scanner()
        self._state = _FencedState.OBJECT

    def _object(self, text: str) -> int:
        used, outcome = feed_call(self._calls, self._scanner, text)
        if outcome is Outcome.ENDED:
            self._hide_close = self._fenced
            if self._in_list:
                self._state = _FencedState.LIST_NEXT
            else:
                self._state = _FencedState.FENCE_END if self._fenced else _FencedState.IDLE
        elif outcome is Outcome.REJECTED:
            if self._scanner.done or self._scanner.failed:
                self._not_a_call()
            else:
                self._state = _FencedState.REST
        return used

    def _not_a_call(self) -> None:
        """The JSON (or list, or fence body) is not a call: a fence is code to its close."""
        self._in_list = False
        self._state = _FencedState.CODE if self._fenced else _FencedState.IDLE
