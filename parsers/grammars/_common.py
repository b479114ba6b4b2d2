"""What every call grammar shares: Lark literals and regex pieces, the declared tools as
the grammars see them, the `CallGrammar` a format builds, and the lazy `start` that
leaves text free until the model writes a call opener."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Tag = Callable[[str], str]  # a marker -> a grammar item (its special token, or its text)
Schema = Mapping[str, Any]

# A string parameter's schema may carry `{"syntax": "lark" | "regex", "definition": ...}`
# under this key: its value is then text in that grammar (Responses' custom tools).
GRAMMAR_KEY = "x-grammar"
ANY_OBJECT: Schema = {"type": "object"}
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


@dataclass(frozen=True)
class CallGrammar:
    """A format's call grammar over a set of tools (Lark in llguidance's dialect).

    `rules` define `calls`: one or more complete calls (exactly one without parallel
    calls), each from its opener on. `opener` is the text a forced call's prompt ends
    with, and `after_opener` the whole grammar of what follows it: the rest of that
    call, then the further calls `calls` allows. `lazy` is the grammar of a reply that
    may call (tool_choice auto): free text, in which each call opener starts a call
    the grammar then keeps to. `parts` are the nested grammars these refer to
    (`@name`), such as a custom tool's own grammar."""

    rules: str
    opener: str
    after_opener: str
    lazy: str
    parts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ToolDef:
    """One declared tool: `key` names its rules (unique within a grammar)."""

    name: str
    params: Schema
    key: str


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark `/regex/`."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(f"\\x{{{ord(ch):x}}}")
    return "".join(out)


def containing(markers: Iterable[str]) -> str:
    """A Lark regex for text that contains one of `markers`."""
    alternatives = "|".join(regex_literal(m) for m in sorted(set(markers)))
    return f"/(?s:.*)({alternatives})(?s:.*)/"


def is_token(item: str) -> bool:
    """Whether a tagged marker is a special token (free text cannot spell it)."""
    return item.startswith("<[")


def tool_defs(tools: Sequence[Mapping[str, Any]], only: Sequence[str] | None) -> list[ToolDef]:
    """The declared tools (OpenAI-shaped, or the flat {"name", "parameters"} shape), or
    those named in `only`; a missing or empty parameters schema is any object."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        name = str(fn["name"])
        if only is not None and name not in only:
            continue
        params = fn.get("parameters")
        schema = params if isinstance(params, Mapping) and params else ANY_OBJECT
        out.append(ToolDef(name, schema, f"t{i}"))
    return out


def members(params: Schema) -> list[tuple[str, Schema, bool]] | None:
    """(name, schema, required) for each argument a call writes in an XML-like format:
    the declared properties in order, then required names only a pattern or
    `additionalProperties` admits. None when the schema is not an object's."""
    kind = params.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return None
    props = params.get("properties")
    declared: Mapping[str, Any] = props if isinstance(props, Mapping) else {}
    required = [r for r in params.get("required") or () if isinstance(r, str)]
    extra = params.get("additionalProperties", True)
    out: list[tuple[str, Schema, bool]] = []
    for name in [*declared, *(r for r in required if r not in declared)]:
        schema = declared.get(name, extra)
        if schema is False:  # no value is valid: the argument cannot be written
            if name in required:
                return None
            continue
        out.append((str(name), schema if isinstance(schema, Mapping) else {}, name in required))
    return out


def lazy_start(triggers: Sequence[tuple[str, str]], *, tag: Tag, parallel: bool) -> str:
    """The rules of a reply that is free text until it writes one of the `triggers`
    (marker, rule): from the marker on, what follows keeps to the rule; then text is
    free again (with `parallel`, until the next call; else no further call can start).
    Free text never contains a trigger's text, spelled out or as its special token:
    the output parser would read a call there that the grammar never checked."""
    lines = [f"FREE: /(?s:.+)/ & ~{containing(m for m, _ in triggers)}"]
    segments = []
    for i, (marker, rule) in enumerate(triggers):
        item = tag(marker)
        if is_token(item):
            segments.append(f"FREE? {item} {rule}")
        else:
            # the lexeme runs to the trigger's first occurrence: the call starts there
            lines.append(f"opens_{i}[lazy]: FREE? {lit(marker)}")
            segments.append(f"opens_{i} {rule}")
    repeat = "*" if parallel else "?"
    head = [f"start: segment{repeat} FREE?", f"segment: {' | '.join(segments)}"]
    return "\n".join([*head, *lines, ""])
