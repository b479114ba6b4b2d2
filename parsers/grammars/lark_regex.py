"""A Lark grammar without recursion, flattened into one regular expression.

A JSON string's content can be made to follow a regex (a JSON schema's `pattern`: the
engine escapes it into the string), but not a context-free grammar. Custom tools'
grammars are often regular in fact (Codex's apply_patch is): every rule is then
substituted into the start rule, and the tool-call formats that carry the tool's input
inside a JSON string can keep to it too. Recursive rules, `%ignore`, templates and
llguidance's own extensions (rule options, `%json`, nested grammars) are not flattened:
`lark_to_regex` returns None and the input stays free text.

Each use of a rule copies its regex, so rules that use the next one twice double the
output at every level (30 levels: gigabytes). The size is bounded while expanding: a
regex longer than MAX_REGEX_CHARS, or more than MAX_EXPANSION_CHARS built in all, stops
the expansion at once with `GrammarTooLarge`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+|//[^\n]*|\#[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"i?)
    |(?P<regex>/(?:[^/\\\n]|\\.)+/[imsx]*)
    |(?P<alias>->\s*[_a-zA-Z][_a-zA-Z0-9]*)
    |(?P<name>[?!]?[_a-zA-Z][_a-zA-Z0-9]*(?:\.-?\d+)?)
    |(?P<number>\d+)
    |(?P<range>\.\.)
    |(?P<punct>[:|()\[\]?*+~{},])
    """,
    re.VERBOSE,
)
# `%import common.X`: the terminals of Lark's common.lark this accepts.
_COMMON: Mapping[str, str] = {
    "LF": r"\n",
    "CR": r"\r",
    "NEWLINE": r"(?:\r?\n)+",
    "WS": r"[ \t\f\r\n]+",
    "WS_INLINE": r"[ \t]+",
    "DIGIT": r"[0-9]",
    "HEXDIGIT": r"[a-fA-F0-9]",
    "INT": r"[0-9]+",
    "LETTER": r"[A-Za-z]",
    "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]",
    "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
}
MAX_REGEX_CHARS = 50_000  # the regex of the start rule, and of any rule or group in it
# All text built while flattening (a rule's regex is built once, then copied into each
# use): bounds the work and memory of a long chain of rules that each use the one before.
MAX_EXPANSION_CHARS = 40 * MAX_REGEX_CHARS


class _Unsupported(Exception):
    pass


class GrammarTooLarge(Exception):
    """The grammar flattens to more than the bounds above; raised as soon as it does."""


def lark_to_regex(grammar: str) -> str | None:
    """The language of `grammar`'s start rule as one regex (Rust syntax), or None when
    the grammar is not regular in the way this reads it, or uses what it cannot.
    GrammarTooLarge when it flattens past MAX_REGEX_CHARS or MAX_EXPANSION_CHARS."""
    try:
        rules = _definitions(grammar)
        if "start" not in rules:
            return None
        return _Flattener(rules).rule("start")
    except (_Unsupported, ValueError, SyntaxError, RecursionError):
        return None


def _definitions(grammar: str) -> dict[str, list[tuple[str, str]]]:
    """Rule and terminal name -> the tokens of its body."""
    body_lines = []
    imported: dict[str, list[tuple[str, str]]] = {}
    for line in grammar.splitlines():
        stripped = line.strip()
        if not stripped.startswith("%"):
            body_lines.append(line)
            continue
        found = re.fullmatch(r"%import\s+common\.([A-Z_]+)(?:\s*->\s*([A-Z_]+))?", stripped)
        if found is None or found.group(1) not in _COMMON:
            raise _Unsupported(stripped)
        imported[found.group(2) or found.group(1)] = [("common", _COMMON[found.group(1)])]
    tokens = _tokens("\n".join(body_lines))
    rules: dict[str, list[tuple[str, str]]] = dict(imported)
    current: list[tuple[str, str]] | None = None
    for i, (kind, text) in enumerate(tokens):
        if kind == "name" and i + 1 < len(tokens) and tokens[i + 1] == ("punct", ":"):
            name = text.lstrip("?!").split(".")[0]
            current = rules.setdefault(name, [])
            if current:
                current.append(("punct", "|"))  # a second definition adds alternatives
            continue
        if (kind, text) == ("punct", ":") and i > 0 and tokens[i - 1][0] == "name":
            continue
        if current is None:
            raise _Unsupported(text)
        current.append((kind, text))
    return rules


def _tokens(text: str) -> list[tuple[str, str]]:
    out = []
    pos = 0
    while pos < len(text):
        found = _TOKEN.match(text, pos)
        if found is None:
            raise _Unsupported(text[pos : pos + 20])
        pos = found.end()
        kind = found.lastgroup or ""
        if kind == "alias":
            continue  # `-> name` renames a tree node: nothing to match
        if kind != "ws":
            out.append((kind, found.group()))
    return out


class _Flattener:
    def __init__(self, rules: Mapping[str, list[tuple[str, str]]]) -> None:
        self._rules = rules
        self._done: dict[str, str] = {}
        self._open: set[str] = set()
        self.built = 0  # characters of regex built so far (MAX_EXPANSION_CHARS)

    def _join(self, parts: list[str], sep: str = "") -> str:
        """`parts` (checked by `_grow` on the way) joined, and counted."""
        text = sep.join(parts)
        self.built += len(text)
        if self.built > MAX_EXPANSION_CHARS:
            raise GrammarTooLarge(
                f"flattening its grammar builds more than {MAX_EXPANSION_CHARS} characters of "
                "regular expression (each use of a rule copies the rule)"
            )
        return text

    @staticmethod
    def _grow(size: int, part: str) -> int:
        """`size` plus `part`, checked before anything longer than the bound is built."""
        size += len(part) + 1
        if size > MAX_REGEX_CHARS:
            raise GrammarTooLarge(
                f"its grammar flattens to a regular expression of more than {MAX_REGEX_CHARS} "
                "characters (each use of a rule copies the rule)"
            )
        return size

    def rule(self, name: str) -> str:
        if name in self._done:
            return self._done[name]
        if name in self._open or name not in self._rules:
            raise _Unsupported(name)  # recursion, or an undefined name
        self._open.add(name)
        tokens = self._rules[name]
        regex, end = self._alternatives(tokens, 0)
        if end != len(tokens):
            raise _Unsupported(name)
        self._open.discard(name)
        self._done[name] = regex
        return regex

    def _alternatives(self, tokens: list[tuple[str, str]], pos: int) -> tuple[str, int]:
        options: list[str] = []
        size = 0
        while True:
            regex, pos = self._sequence(tokens, pos)
            size = self._grow(size, regex)
            options.append(regex)
            if pos < len(tokens) and tokens[pos] == ("punct", "|"):
                pos += 1
                continue
            if len(options) == 1:
                return options[0], pos
            return f"(?:{self._join(options, '|')})", pos

    def _sequence(self, tokens: list[tuple[str, str]], pos: int) -> tuple[str, int]:
        items: list[str] = []
        size = 0
        while pos < len(tokens) and tokens[pos] not in (
            ("punct", "|"),
            ("punct", ")"),
            ("punct", "]"),
        ):
            item, pos = self._item(tokens, pos)
            size = self._grow(size, item)
            items.append(item)
        return self._join(items), pos

    def _item(self, tokens: list[tuple[str, str]], pos: int) -> tuple[str, int]:
        atom, pos = self._atom(tokens, pos)
        if pos >= len(tokens):
            return atom, pos
        kind, text = tokens[pos]
        if kind == "punct" and text in "?*+":
            return f"(?:{atom}){text}", pos + 1
        if (kind, text) == ("punct", "~"):
            low, pos = _number(tokens, pos + 1)
            high = low
            if pos < len(tokens) and tokens[pos][0] == "range":
                high, pos = _number(tokens, pos + 1)
            return f"(?:{atom}){{{low},{high}}}", pos
        if (kind, text) == ("punct", "{"):
            end = next(i for i in range(pos, len(tokens)) if tokens[i] == ("punct", "}"))
            inner = "".join(t for _, t in tokens[pos + 1 : end])
            if not re.fullmatch(r"\d*(?:,\d*)?", inner) or inner in ("", ","):
                raise _Unsupported(inner)
            bounds = "0" + inner if inner.startswith(",") else inner
            return f"(?:{atom}){{{bounds}}}", end + 1
        return atom, pos

    def _atom(self, tokens: list[tuple[str, str]], pos: int) -> tuple[str, int]:
        kind, text = tokens[pos]
        if kind == "punct" and text in "([":
            inner, end = self._alternatives(tokens, pos + 1)
            closing = ")" if text == "(" else "]"
            if end >= len(tokens) or tokens[end] != ("punct", closing):
                raise _Unsupported(text)
            return (f"(?:{inner})" if text == "(" else f"(?:{inner})?"), end + 1
        if kind == "string":
            literal = _string(text)
            if pos + 2 < len(tokens) and tokens[pos + 1][0] == "range":
                high = _string(tokens[pos + 2][1])
                return f"[{_escape(literal)}-{_escape(high)}]", pos + 3
            return literal_regex(literal, text.endswith("i")), pos + 1
        if kind == "regex":
            return _regex(text), pos + 1
        if kind == "common":
            return f"(?:{text})", pos + 1
        if kind == "name":
            return f"(?:{self.rule(text)})", pos + 1
        raise _Unsupported(text)


def _number(tokens: list[tuple[str, str]], pos: int) -> tuple[int, int]:
    if pos >= len(tokens) or tokens[pos][0] != "number":
        raise _Unsupported("~")
    return int(tokens[pos][1]), pos + 1


def _string(token: str) -> str:
    body = token[:-1] if token.endswith("i") else token
    value = ast.literal_eval(body)
    if not isinstance(value, str):
        raise _Unsupported(token)
    return value


def _escape(text: str) -> str:
    return "".join(
        "\\" + ch
        if ch in "\\.+*?()|[]{}^$#&-~"
        else ch
        if ch.isprintable()
        else f"\\x{{{ord(ch):x}}}"
        for ch in text
    )


def literal_regex(text: str, insensitive: bool = False) -> str:
    escaped = _escape(text)
    return f"(?i:{escaped})" if insensitive else escaped


def _regex(token: str) -> str:
    end = token.rindex("/")
    body, flags = token[1:end].replace("\\/", "/"), token[end + 1 :]
    if set(flags) - set("ims"):
        raise _Unsupported(flags)
    return f"(?{flags}:{body})" if flags else f"(?:{body})"
