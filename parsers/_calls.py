"""Content output and tool-call assembly shared by the tool-call formats.

A call is held back (with the raw text it came from) until it can be committed: its
name is a declared tool and every required argument has begun (and, for a gated call,
its format has opened the gate). From then on its arguments stream as JSON text
fragments. A call that ends without being committable
becomes content again, as it was written, unless the output was cut short (`truncated`)
inside the format's own markup: then the unfinished markup is dropped, never shown as
text. A committed call always ends with its JSON object closed.
"""

from __future__ import annotations

import secrets

from parsers._schema import ToolSet, ToolSpec, escape
from parsers.events import Content, Event, ToolCallArgs, ToolCallEnd, ToolCallStart


class Out:
    """Collects events; holds back trailing whitespace of content, so that whitespace
    next to tool-call markup can be dropped without delaying anything else."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._ws = ""
        self._skip_ws = False

    def content(self, text: str) -> None:
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        body = text.rstrip()
        if body:
            self.events.append(Content(self._ws + body))
            self._ws = text[len(body) :]
        else:
            self._ws += text

    def take_ws(self) -> str:
        """The held whitespace, handed to a tool call that starts here."""
        ws, self._ws = self._ws, ""
        return ws

    def after_call(self) -> None:
        """Whitespace right after a tool call is markup padding, not content."""
        self._skip_ws = True

    def flush(self) -> None:
        if self._ws and not self._skip_ws:
            self.events.append(Content(self._ws))
        self._ws = ""

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


class _Call:
    """One call in progress (mutable, private to ToolCalls)."""

    def __init__(self, raw: str, gated: bool) -> None:
        self.raw: list[str] = [raw]
        self.gated = gated
        self.tagged = not gated  # begun by the format's markup, not guessed from JSON
        self.spec: ToolSpec | None = None
        self.pending: list[str] = []
        self.keys: set[str] = set()
        self.members = 0
        self.open_string = False
        self.doomed = False
        self.index = -1


class ToolCalls:
    """Turns a format's findings (name, argument members) into tool-call events."""

    def __init__(self, tools: ToolSet, out: Out) -> None:
        self.tools = tools
        self._out = out
        self._call: _Call | None = None
        self._next_index = 0
        self._ids: set[str] = set()
        self.truncated = False  # the output stopped at its token limit (set by `finish`)

    @property
    def active(self) -> bool:
        return self._call is not None

    @property
    def committed(self) -> bool:
        return self._call is not None and self._call.index >= 0

    @property
    def spec(self) -> ToolSpec | None:
        return self._call.spec if self._call else None

    def begin(self, raw: str, *, gated: bool = False) -> None:
        """A call starts. A gated one cannot commit (nor end as a call) before
        `open_gate`: untagged JSON is a call only once its arguments have begun."""
        if self._call is not None:
            self.end()
        self._call = _Call(raw, gated)

    def open_gate(self) -> None:
        if self._call is not None:
            self._call.gated = False
            self._try_commit()

    def raw(self, text: str) -> None:
        """Records model text of the call, to give back as content if it fails."""
        call = self._call
        if call is not None and call.index < 0 and text:
            call.raw.append(text)

    @property
    def doomed(self) -> bool:
        """The call can no longer be committed; its format should `reject` it."""
        return self._call is not None and self._call.doomed

    def doom(self) -> None:
        if self._call is not None and self._call.index < 0:
            self._call.doomed = True

    def set_name(self, name: str) -> bool:
        """False (and the call is doomed) when the tool is not declared: a tool name
        is never guessed or repaired."""
        call = self._call
        if call is None:
            return False
        if call.spec is not None:
            return True  # a second name (a repeated "name" key) does not rename the call
        call.spec = self.tools.get(name.strip())
        if call.spec is None:
            self.doom()
            return False
        self._try_commit()
        return True

    def seen(self, key: str) -> None:
        """An argument has begun; it counts towards the required ones."""
        if self._call is not None:
            self._call.keys.add(key)
            self._try_commit()

    def member(self, key: str, value_json: str) -> None:
        """A complete argument, its value already JSON text."""
        self._member_head(key)
        self._emit(value_json)

    def begin_string(self, key: str, *, count: bool = True) -> None:
        """An argument whose string value follows in `string_chunk` pieces. With
        `count` False it does not count towards the required ones yet (the caller
        says `seen` when the string is complete)."""
        self._member_head(key, count)
        self._emit('"')
        if self._call is not None:
            self._call.open_string = True

    def string_chunk(self, text: str) -> None:
        if text:
            self._emit(escape(text))

    def end_string(self) -> None:
        if self._call is not None and self._call.open_string:
            self._call.open_string = False
            self._emit('"')

    def reject(self) -> None:
        """Gives the call back as content; a committed call is ended instead."""
        call = self._call
        if call is None:
            return
        if call.index >= 0:
            self.end()
            return
        self._call = None
        if not (self.truncated and call.tagged):
            self._out.content("".join(call.raw))

    def end(self) -> bool:
        """Ends the call: emitted if it is valid (True), else it becomes content."""
        call = self._call
        if call is None:
            return False
        if call.index < 0:
            spec = call.spec
            if spec is None or call.doomed or call.gated or not spec.required <= call.keys:
                self.reject()
                return False
            self._commit(call, spec)
        self.end_string()
        self._emit("}" if call.members else "{}")
        self._out.events.append(ToolCallEnd(call.index))
        self._call = None
        self._out.after_call()
        return True

    def _member_head(self, key: str, count: bool = True) -> None:
        call = self._call
        if call is None:
            return
        self.end_string()
        self._emit(("{" if call.members == 0 else ", ") + escape_key(key) + ": ")
        call.members += 1
        if count:
            self.seen(key)

    def _emit(self, fragment: str) -> None:
        call = self._call
        if call is None or not fragment:
            return
        if call.index >= 0:
            self._out.events.append(ToolCallArgs(call.index, fragment))
        else:
            call.pending.append(fragment)

    def _try_commit(self) -> None:
        call = self._call
        if call is None or call.index >= 0 or call.spec is None or call.doomed or call.gated:
            return
        if call.spec.required <= call.keys:
            self._commit(call, call.spec)

    def _commit(self, call: _Call, spec: ToolSpec) -> None:
        call.index = self._next_index
        self._next_index += 1
        self._out.events.append(ToolCallStart(call.index, self._new_id(), spec.name))
        if call.pending:
            self._out.events.append(ToolCallArgs(call.index, "".join(call.pending)))
        call.pending = []
        call.raw = []

    def _new_id(self) -> str:
        while True:
            new = "call_" + secrets.token_hex(12)
            if new not in self._ids:
                self._ids.add(new)
                return new


def escape_key(key: str) -> str:
    return '"' + escape(key) + '"'
