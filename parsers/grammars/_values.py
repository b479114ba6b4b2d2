"""Argument values in the XML-like formats (qwen3-coder, glm), as the output parser
reads them back (parsers/_schema.py `coerce_text`).

The parser turns a value's text into the first non-string type of the schema it parses
as, and keeps it as a string otherwise, whenever the schema allows a string (or says
no type at all). So a parameter that may be a string is written as raw text (never as
JSON: `"abc"` would come back with its quotes), and that text must not read as one of
the schema's other types; a parameter that cannot be a string is written as JSON for
its schema. Raw text keeps to the string keywords (length, enum, const, pattern; not
format) and never contains the format's markers, which would end the value early.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from parsers.grammars._common import GRAMMAR_KEY, Schema, containing, regex_literal
from parsers.schema_types import alternatives
from runtime.text import ConstraintError, check, lark_constraint

# What the parser's `_parse_as` takes for each type (after stripping whitespace).
_PARSES_AS = {
    "integer": r"/\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*/",
    "number": r"/\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*/",
    "boolean": r"/\s*(?i:true|false)\s*/",
    "null": r"/\s*(?i:null|none)\s*/",
    "object": r"/\s*[\[{(](?s:.*)/",
    "array": r"/\s*[\[{(](?s:.*)/",
}
_WORDS = {"boolean": ("true", "false"), "null": ("null",)}
_UNESCAPED_SLASH = re.compile(r"(?<!\\)/")
_REF_DEPTH = 8


@dataclass(frozen=True)
class ValueForm:
    """How one argument's value is written: exactly one field is set. `raw` is a Lark
    terminal expression for its text, `json` the schema of a JSON value, `grammar` a
    custom tool's (syntax, definition)."""

    raw: str | None = None
    json: Schema | None = None
    grammar: tuple[str, str] | None = None


def value_form(schema: Schema, root: Schema, markers: Iterable[str]) -> ValueForm | None:
    """The form of a value for `schema` (inside the parameters schema `root`), or None
    when the parser cannot read back any value valid for it (an untyped enum of
    numbers, say: untyped values come back as strings)."""
    custom = schema.get(GRAMMAR_KEY)
    if isinstance(custom, Mapping) and custom.get("syntax") in ("lark", "regex"):
        return ValueForm(grammar=(str(custom["syntax"]), str(custom.get("definition", ""))))
    alts = list(alternatives(schema))
    stringish = [sub for kind, sub in alts if kind in (None, "string")]
    if not stringish:
        return ValueForm(json=_with_definitions(schema, root))
    pieces = [p for p in (_string_regex(_resolve(sub, root, 0)) for sub in stringish) if p]
    if not pieces:
        return None
    body = pieces[0] if len(pieces) == 1 else " | ".join(f"({p})" for p in pieces)
    terms = [f"({body})", f"~{containing(markers)}"]
    typed = {kind for kind, _ in alts if kind in _PARSES_AS}
    terms += sorted({f"~{_PARSES_AS[kind]}" for kind in typed})
    raw = " & ".join(terms)
    # the parser reads these words back as true, false and null: valid for a plain
    # boolean or null alternative
    words = sorted({w for kind, sub in alts if kind and _plain(sub) for w in _WORDS.get(kind, ())})
    if words:
        raw = f"({raw}) | /({'|'.join(words)})/"
    return ValueForm(raw=raw)


def _plain(schema: Schema) -> bool:
    return not any(k in schema for k in ("enum", "const", "not", "allOf", "$ref"))


def _with_definitions(schema: Schema, root: Schema) -> Schema:
    """A value's schema with the parameters schema's definitions, which its `$ref`s
    may name."""
    shared = {k: root[k] for k in ("$defs", "definitions") if k in root and k not in schema}
    return {**schema, **shared} if shared else schema


def _resolve(schema: Schema, root: Schema, depth: int) -> Schema | None:
    """`schema` with a local `$ref` (#/$defs/..., #/definitions/...) merged in; None
    when a reference cannot be followed."""
    ref = schema.get("$ref")
    if not isinstance(ref, str):
        return schema
    if depth >= _REF_DEPTH or not ref.startswith("#"):
        return None
    target: Any = root
    for step in filter(None, ref[1:].split("/")):
        key = step.replace("~1", "/").replace("~0", "~")
        target = target.get(key) if isinstance(target, Mapping) else None
    if not isinstance(target, Mapping):
        return None
    merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return _resolve(merged, root, depth + 1)


def _string_regex(schema: Schema | None) -> str | None:
    """A Lark terminal expression for the strings valid for `schema` (its string
    keywords), or None if no string is."""
    if schema is None:
        return None
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else list(kind) if isinstance(kind, list) else []
    if kinds and "string" not in kinds:
        return None
    terms = []
    values = _enum(schema)
    if values is not None:
        strings = sorted({v for v in values if isinstance(v, str)})
        if not strings:
            return None
        terms.append("/(" + "|".join(regex_literal(s) for s in strings) + ")/")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        terms += _pattern(pattern)
    low, high = _int(schema.get("minLength"), 0), _int(schema.get("maxLength"), None)
    if high is not None:
        terms.append(f"/(?s:.{{{low},{high}}})/")
    else:
        terms.append(f"/(?s:.{{{low},}})/" if low else "/(?s:.*)/")
    return " & ".join(terms)


def _enum(schema: Schema) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    values = schema.get("enum")
    return list(values) if isinstance(values, list) else None


def _int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _pattern(pattern: str) -> list[str]:
    """A JSON-schema pattern (unanchored unless it says ^ or $) as a Lark regex; none
    when the engine cannot compile it (then it is left unenforced, as with format)."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not pattern.endswith("\\$")
    body = pattern[1 if start else 0 : len(pattern) - 1 if end else len(pattern)]
    body = _UNESCAPED_SLASH.sub(r"\/", body)
    regex = ("" if start else "(?s:.*)") + f"(?:{body})" + ("" if end else "(?s:.*)")
    try:
        check(lark_constraint(f"start: /{regex}/"))
    except ConstraintError:
        return []
    return [f"/{regex}/"]
