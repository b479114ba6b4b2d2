"""Tool calls written as JSON: the call object ({"name", "arguments"}) and the
arguments object, read incrementally into `ToolCalls` (hermes, llama3, deepseek).

A call written in the format's own markup (tags) is trusted: values that fit no schema
type are sent as written. Untagged JSON is only a guess at a call (`guess=True`), so it
must earn it: its shape, its tool's name and every argument before the call starts
must check out, or it stays text (parsers/_fenced.py).
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

from parsers._calls import ToolCalls
from parsers._json_stream import ObjectScanner
from parsers._schema import (
    allows_string,
    coerce_text,
    coerce_value,
    conforms,
    dumps,
    loads,
)
from parsers.schema_types import Schema

NAME_KEYS = ("name",)
ARG_KEYS = ("arguments", "parameters")
GUESS_LEAD_KEYS = ("name", "function", "type")  # how a JSON call object opens


class ArgsSink:
    """Top-level members of an arguments object. Strings the schema allows stream as
    they arrive; other values are buffered, then coerced to the schema.

    `strict` (untagged calls): an argument counts towards the required ones only once
    its value is complete (a guessed call cut off inside a required value is text, not
    a call with half a path); arguments the schema forbids are dropped; a value that
    fits no schema type even after coercion makes the call invalid while it has not
    started, or is left out once it has (a started call cannot be taken back)."""

    def __init__(self, calls: ToolCalls, strict: bool = False) -> None:
        self._calls = calls
        self._strict = strict
        self._key = ""
        self._raw: list[str] | None = None  # None while a string value streams
        self._drop = False

    def key(self, key: str, first: str) -> bool:
        self._key = key
        self._drop = self._strict and self._undeclared(key)
        if self._drop:
            self._raw = None
            return False
        if first == '"' and allows_string(self._schema(key)):
            self._raw = None
            self._calls.begin_string(key, count=not self._strict)
            return True
        self._raw = []
        if not self._strict:
            self._calls.seen(key)  # strict: it counts once its value has checked out
        return False

    def chunk(self, text: str) -> None:
        if self._drop:
            return
        if self._raw is None:
            self._calls.string_chunk(text)
        else:
            self._raw.append(text)

    def end(self) -> None:
        if self._drop:
            self._drop = False
            return
        if self._raw is None:
            self._calls.end_string()
            if self._strict:
                self._calls.seen(self._key)
            return
        raw, self._raw = "".join(self._raw), None
        schema = self._schema(self._key)
        try:
            value = coerce_value(loads(raw), schema)
        except (ValueError, RecursionError):
            value = coerce_text(raw, schema)  # True, None, bare words: Python-isms
        self._put(self._key, value)

    def cut(self) -> None:
        self._raw = None  # a half-written non-string value is dropped
        self._drop = False

    def members(self, args: dict[str, object]) -> None:
        """Arguments that arrived whole (double-encoded as a JSON string)."""
        items = [
            (key, coerce_value(value, self._schema(key)))
            for key, value in args.items()
            if not (self._strict and self._undeclared(key))
        ]
        fits = all(conforms(value, self._schema(key)) for key, value in items)
        if self._strict and not fits and not self._calls.committed:
            self._calls.doom()
            return
        for key, value in items:
            self._put(key, value)

    def _put(self, key: str, value: Any) -> None:
        if self._strict and not conforms(value, self._schema(key)):
            if not self._calls.committed:
                self._calls.doom()
            return
        self._calls.member(key, dumps(value))

    def _schema(self, key: str) -> Schema | None:
        spec = self._calls.spec
        return spec.schema(key) if spec else None

    def _undeclared(self, key: str) -> bool:
        spec = self._calls.spec
        return spec is not None and spec.undeclared(key)


class _Mode(Enum):
    SKIP = auto()
    NAME = auto()
    ARGS = auto()
    ARGS_STRING = auto()
    TYPE = auto()  # guess: "type" must say "function"
    FUNCTION = auto()  # guess: {"type": "function", "function": {"name", "arguments"}}


class CallObjectSink:
    """Members of {"name": ..., "arguments": {...}}. With `strict_keys`, any other key
    means this JSON is not a tool call (Llama writes calls as the whole message, so
    ordinary JSON answers must fall back to content early).

    `guess` (untagged JSON, strict keys implied): the object must open with name,
    function or type; the name must stay a prefix of a declared tool's as it streams;
    the arguments must follow the name, and open the call's gate."""

    def __init__(
        self, calls: ToolCalls, strict_keys: bool = False, guess: bool = False, nested: bool = False
    ) -> None:
        self._calls = calls
        self._strict = strict_keys or guess
        self._guess = guess
        self._nested = nested  # the inner object of the {"function": {...}} shape
        self._first = True
        self._mode = _Mode.SKIP
        self._buf: list[str] = []
        self._args_sink = ArgsSink(calls, strict=guess)
        self._args: ObjectScanner | None = None
        self._inner: ObjectScanner | None = None

    def key(self, key: str, first: str) -> bool:
        self._buf = []
        lead, self._first = self._first, False
        if self._guess and lead and key not in (NAME_KEYS if self._nested else GUESS_LEAD_KEYS):
            self._calls.doom()
            self._mode = _Mode.SKIP
        else:
            self._mode = self._mode_for(key, first)
        return self._mode in (_Mode.NAME, _Mode.ARGS_STRING, _Mode.TYPE)

    def _mode_for(self, key: str, first: str) -> _Mode:
        if key in NAME_KEYS and first == '"':
            return _Mode.NAME
        if key in ARG_KEYS and first in '{"' and self._args is None:
            if self._guess:
                if self._calls.spec is None:  # arguments before the name: not our shape
                    self._calls.doom()
                    return _Mode.SKIP
                self._calls.open_gate()
            if first == '"':
                return _Mode.ARGS_STRING
            self._args = ObjectScanner(self._args_sink)
            return _Mode.ARGS
        if self._guess and not self._nested and key == "type" and first == '"':
            return _Mode.TYPE
        function = key == "function" and first == "{" and self._inner is None
        if self._guess and not self._nested and function:
            self._inner = ObjectScanner(CallObjectSink(self._calls, guess=True, nested=True))
            return _Mode.FUNCTION
        if self._strict and (self._guess or key != "type"):
            self._calls.doom()
        return _Mode.SKIP

    def chunk(self, text: str) -> None:
        mode = self._mode
        if mode is _Mode.ARGS and self._args is not None:
            self._args.feed(text)
        elif mode is _Mode.FUNCTION and self._inner is not None:
            self._inner.feed(text)
        elif mode is not _Mode.SKIP:
            self._buf.append(text)
            # a name can only be as long as the longest tool's, so this stays cheap
            name = "".join(self._buf).lstrip() if mode is _Mode.NAME and self._guess else ""
            if name and not self._calls.tools.has_prefix(name):
                self._calls.doom()
                self._mode = _Mode.SKIP

    def end(self) -> None:
        mode, self._mode = self._mode, _Mode.SKIP
        if mode is _Mode.NAME:
            self._calls.set_name("".join(self._buf))
        elif mode is _Mode.TYPE:
            if "".join(self._buf) != "function":
                self._calls.doom()
        elif mode is _Mode.FUNCTION:
            if self._inner is None or not self._inner.done:
                self._calls.doom()
        elif mode is _Mode.ARGS_STRING:
            self._args = ObjectScanner(self._args_sink)  # marks the arguments as seen
            try:
                args = loads("".join(self._buf))
            except (ValueError, RecursionError):
                args = None
            if isinstance(args, dict):
                self._args_sink.members(args)
            elif self._guess:
                self._calls.doom()

    def cut(self) -> None:
        if self._mode is _Mode.ARGS and self._args is not None:
            self._args.finish()
        elif self._mode is _Mode.FUNCTION and self._inner is not None:
            self._inner.finish()


class Outcome(Enum):
    MORE = auto()  # the call goes on
    ENDED = auto()  # the call was emitted
    REJECTED = auto()  # the call was given back as content


def feed_call(calls: ToolCalls, scanner: ObjectScanner, text: str) -> tuple[int, Outcome]:
    """Feeds a call's JSON text; ends or rejects the call when the scan decides it.
    Returns how much text the call used (the rest follows the object, or, after a
    rejection while the scan is still inside the object, the rest of the object)."""
    used = scanner.feed(text)
    calls.raw(text[:used])
    if calls.doomed or (scanner.failed and not calls.committed):
        calls.reject()
        return used, Outcome.REJECTED
    if scanner.done or scanner.failed:
        return used, Outcome.ENDED if calls.end() else Outcome.REJECTED
    return used, Outcome.MORE


def end_call(calls: ToolCalls, scanner: ObjectScanner) -> Outcome:
    """The call's text is over (a closing marker or the end of the stream)."""
    scanner.finish()
    if not calls.active:
        return Outcome.ENDED
    if calls.doomed:
        calls.reject()
        return Outcome.REJECTED
    return Outcome.ENDED if calls.end() else Outcome.REJECTED
