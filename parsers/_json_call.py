"""Tool calls written as JSON: the call object ({"name", "arguments"}) and the
arguments object, read incrementally into `ToolCalls` (hermes, llama3, deepseek)."""

from __future__ import annotations

from enum import Enum, auto

from parsers._calls import ToolCalls
from parsers._json_stream import ObjectScanner
from parsers._schema import Schema, allows_string, coerce_text, coerce_value, dumps, loads

NAME_KEYS = ("name",)
ARG_KEYS = ("arguments", "parameters")


class ArgsSink:
    """Top-level members of an arguments object. Strings the schema allows stream as
    they arrive; other values are buffered, then coerced to the schema."""

    def __init__(self, calls: ToolCalls) -> None:
        self._calls = calls
        self._key = ""
        self._raw: list[str] | None = None  # None while a string value streams

    def key(self, key: str, first: str) -> bool:
        self._key = key
        if first == '"' and allows_string(self._schema(key)):
            self._raw = None
            self._calls.begin_string(key)
            return True
        self._raw = []
        self._calls.seen(key)
        return False

    def chunk(self, text: str) -> None:
        if self._raw is None:
            self._calls.string_chunk(text)
        else:
            self._raw.append(text)

    def end(self) -> None:
        if self._raw is None:
            self._calls.end_string()
            return
        raw, self._raw = "".join(self._raw), None
        schema = self._schema(self._key)
        try:
            value = coerce_value(loads(raw), schema)
        except (ValueError, RecursionError):
            value = coerce_text(raw, schema)  # True, None, bare words: Python-isms
        self._calls.member(self._key, dumps(value))

    def cut(self) -> None:
        self._raw = None  # a half-written non-string value is dropped

    def members(self, args: dict[str, object]) -> None:
        """Arguments that arrived whole (double-encoded as a JSON string)."""
        for key, value in args.items():
            self._calls.member(key, dumps(coerce_value(value, self._schema(key))))

    def _schema(self, key: str) -> Schema | None:
        spec = self._calls.spec
        return spec.schema(key) if spec else None


class _Mode(Enum):
    SKIP = auto()
    NAME = auto()
    ARGS = auto()
    ARGS_STRING = auto()


class CallObjectSink:
    """Members of {"name": ..., "arguments": {...}}. With `strict_keys`, any other key
    means this JSON is not a tool call (Llama writes calls as the whole message, so
    ordinary JSON answers must fall back to content early)."""

    def __init__(self, calls: ToolCalls, strict_keys: bool = False) -> None:
        self._calls = calls
        self._strict = strict_keys
        self._mode = _Mode.SKIP
        self._buf: list[str] = []
        self._args_sink = ArgsSink(calls)
        self._args: ObjectScanner | None = None

    def key(self, key: str, first: str) -> bool:
        self._buf = []
        if key in NAME_KEYS and first == '"':
            self._mode = _Mode.NAME
        elif key in ARG_KEYS and first == "{" and self._args is None:
            self._mode = _Mode.ARGS
            self._args = ObjectScanner(self._args_sink)
        elif key in ARG_KEYS and first == '"' and self._args is None:
            self._mode = _Mode.ARGS_STRING
        else:
            if self._strict and key != "type":
                self._calls.doom()
            self._mode = _Mode.SKIP
        return self._mode in (_Mode.NAME, _Mode.ARGS_STRING)

    def chunk(self, text: str) -> None:
        if self._mode is _Mode.ARGS and self._args is not None:
            self._args.feed(text)
        elif self._mode is not _Mode.SKIP:
            self._buf.append(text)

    def end(self) -> None:
        mode, self._mode = self._mode, _Mode.SKIP
        if mode is _Mode.NAME:
            self._calls.set_name("".join(self._buf))
        elif mode is _Mode.ARGS_STRING:
            self._args = ObjectScanner(self._args_sink)  # marks the arguments as seen
            try:
                args = loads("".join(self._buf))
            except (ValueError, RecursionError):
                return
            if isinstance(args, dict):
                self._args_sink.members(args)

    def cut(self) -> None:
        if self._mode is _Mode.ARGS and self._args is not None:
            self._args.finish()


class Outcome(Enum):
    MORE = auto()  # the call goes on
    ENDED = auto()  # the call was emitted
    REJECTED = auto()  # the call was given back as content


def feed_call(calls: ToolCalls, scanner: ObjectScanner, text: str) -> tuple[int, Outcome]:
    """Feeds a call's JSON text; ends or rejects the call when the scan decides it.
    Returns how much text the call used (the rest follows the object)."""
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
