"""Incremental scanning of one JSON object whose top-level members go to a sink.

The scanner sees each character once. String values can be delivered decoded, piece
by piece as they arrive (so long arguments stream); any other value is delivered as
its raw JSON text. Decoding is lenient where models are sloppy (raw control
characters, unknown escapes, lone surrogates) and always yields valid text.
"""

from __future__ import annotations

import re
from enum import Enum, auto
from typing import Protocol

_PLAIN = re.compile(r'[^"\\]+')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_WS = frozenset(" \t\r\n")


class StringDecoder:
    """Decodes the inside of a JSON string literal, fed in arbitrary pieces."""

    def __init__(self) -> None:
        self._esc = ""  # a pending escape: "\\" or "\\u" plus up to three hex digits
        self._high = ""  # a high surrogate waiting for its low half

    def feed(self, text: str, pos: int) -> tuple[str, int]:
        """Decoded text from text[pos:], and the index just past the closing quote
        (-1 while the string is still open)."""
        parts: list[str] = []
        n = len(text)
        while pos < n:
            if self._esc:
                pos = self._escape_step(text, pos, parts)
                continue
            plain = _PLAIN.match(text, pos)
            if plain:
                parts.append(self._pair(""))
                parts.append(plain.group())
                pos = plain.end()
                continue
            ch = text[pos]
            pos += 1
            if ch == '"':
                parts.append(self._pair(""))
                return "".join(parts), pos
            self._esc = "\\"
        return "".join(parts), -1

    def finish(self) -> str:
        """What is left when the string is cut off: a dangling escape is dropped."""
        self._esc = ""
        return self._pair("")

    def _escape_step(self, text: str, pos: int, parts: list[str]) -> int:
        ch = text[pos]
        if self._esc == "\\":
            if ch == "u":
                self._esc = "\\u"
                return pos + 1
            self._esc = ""
            known = _ESCAPES.get(ch)
            # An unknown escape keeps its backslash: "\d" in a regex meant exactly that.
            parts.append(self._pair(""))
            parts.append(known if known is not None else ("'" if ch == "'" else "\\" + ch))
            return pos + 1
        if ch in _HEX:
            self._esc += ch
            if len(self._esc) == 6:
                code = int(self._esc[2:], 16)
                self._esc = ""
                parts.append(self._pair(chr(code)))
            return pos + 1
        # "\u" not followed by four hex digits: keep what was written.
        parts.append(self._pair(""))
        parts.append(self._esc)
        self._esc = ""
        return pos

    def _pair(self, ch: str) -> str:
        """Joins surrogate halves; a half without its partner becomes U+FFFD."""
        out = ""
        if self._high:
            if ch and 0xDC00 <= ord(ch) <= 0xDFFF:
                pair = 0x10000 + ((ord(self._high) - 0xD800) << 10) + (ord(ch) - 0xDC00)
                self._high = ""
                return chr(pair)
            out, self._high = "\ufffd", ""
        if ch and 0xD800 <= ord(ch) <= 0xDBFF:
            self._high = ch
            return out
        if ch and 0xDC00 <= ord(ch) <= 0xDFFF:
            return out + "\ufffd"
        return out + ch


class MemberSink(Protocol):
    def key(self, key: str, first: str) -> bool:
        """A member begins; its value starts with `first`. True asks for a string
        value decoded (in `chunk` pieces), False for raw JSON text."""
        ...

    def chunk(self, text: str) -> None: ...

    def end(self) -> None: ...

    def cut(self) -> None:
        """The text stopped inside the value."""
        ...


class _ObjectState(Enum):
    BEFORE = auto()
    KEY_OR_END = auto()
    KEY = auto()
    COLON = auto()
    VALUE_START = auto()
    STRING = auto()
    RAW = auto()
    AFTER_VALUE = auto()
    DONE = auto()
    FAILED = auto()


class ObjectScanner:
    """Scans one JSON object, char by char, handing its top-level members to a sink."""

    def __init__(self, sink: MemberSink, skip_prefix: bool = False) -> None:
        self._sink = sink
        self._skip_prefix = skip_prefix  # tolerate text (a ```json fence) before "{"
        self._state = _ObjectState.BEFORE
        self._decoder = StringDecoder()
        self._key: list[str] = []
        self._decode_value = False
        self._depth = 0  # raw values: nesting depth; -1 for a bare scalar
        self._in_str = False
        self._esc = False
        self._raw_str_top = False  # the raw value is itself a string

    @property
    def done(self) -> bool:
        return self._state is _ObjectState.DONE

    @property
    def failed(self) -> bool:
        return self._state is _ObjectState.FAILED

    @property
    def in_value(self) -> bool:
        return self._state in (_ObjectState.STRING, _ObjectState.RAW)

    def feed(self, text: str) -> int:
        """Consumes text up to the end of the object (or the first character that
        cannot belong to it); returns how much it used."""
        pos, n = 0, len(text)
        while pos < n and self._state not in (_ObjectState.DONE, _ObjectState.FAILED):
            state = self._state
            if state is _ObjectState.STRING:
                pos = self._string_value(text, pos)
            elif state is _ObjectState.RAW:
                pos = self._raw_value(text, pos)
            elif state is _ObjectState.KEY:
                pos = self._key_text(text, pos)
            else:
                self._structural(text[pos])
                if not self.failed:
                    pos += 1
        # On failure the offending character is left for whoever reads on.
        return pos if self._state in (_ObjectState.DONE, _ObjectState.FAILED) else n

    def finish(self) -> None:
        """The text was cut off: a string value in progress is closed where it stands."""
        if self._state is _ObjectState.STRING:
            tail = self._decoder.finish()
            if tail:
                self._sink.chunk(tail)
        if self._state in (_ObjectState.STRING, _ObjectState.RAW):
            self._sink.cut()
        self._state = _ObjectState.FAILED

    def _structural(self, ch: str) -> None:
        state = self._state
        if ch in _WS:
            return
        if state is _ObjectState.BEFORE:
            if ch == "{":
                self._state = _ObjectState.KEY_OR_END
            elif not self._skip_prefix:
                self._state = _ObjectState.FAILED
        elif state is _ObjectState.KEY_OR_END and ch == '"':
            self._state, self._key, self._decoder = _ObjectState.KEY, [], StringDecoder()
        elif state is _ObjectState.KEY_OR_END and ch == "}":
            self._state = _ObjectState.DONE
        elif state is _ObjectState.COLON and ch == ":":
            self._state = _ObjectState.VALUE_START
        elif state is _ObjectState.VALUE_START and ch not in ",:}]":
            self._start_value(ch)
        elif state is _ObjectState.AFTER_VALUE and ch in ",}":
            self._state = _ObjectState.KEY_OR_END if ch == "," else _ObjectState.DONE
        else:
            self._state = _ObjectState.FAILED

    def _key_text(self, text: str, pos: int) -> int:
        part, end = self._decoder.feed(text, pos)
        self._key.append(part)
        if end < 0:
            return len(text)
        self._state = _ObjectState.COLON
        return end

    def _start_value(self, ch: str) -> None:
        key = "".join(self._key)
        self._decode_value = self._sink.key(key, ch) and ch == '"'
        if self._decode_value:
            self._state, self._decoder = _ObjectState.STRING, StringDecoder()
            return
        self._state = _ObjectState.RAW
        self._depth = 1 if ch in "{[" else -1
        self._in_str = self._raw_str_top = ch == '"'
        self._esc = False
        self._sink.chunk(ch)

    def _string_value(self, text: str, pos: int) -> int:
        part, end = self._decoder.feed(text, pos)
        if part:
            self._sink.chunk(part)
        if end < 0:
            return len(text)
        self._sink.end()
        self._state = _ObjectState.AFTER_VALUE
        return end

    def _raw_value(self, text: str, pos: int) -> int:
        start, n = pos, len(text)
        while pos < n:
            ch = text[pos]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self._raw_str_top:
                        return self._raw_end(text, start, pos + 1)
            elif self._depth < 0:
                if ch in _WS or ch in ",}]":
                    return self._raw_end(text, start, pos)
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._raw_end(text, start, pos + 1)
            pos += 1
        self._sink.chunk(text[start:])
        return n

    def _raw_end(self, text: str, start: int, end: int) -> int:
        if end > start:
            self._sink.chunk(text[start:end])
        self._sink.end()
        self._state = _ObjectState.AFTER_VALUE
        return end
