"""Declared tools and coercion of argument values to their JSON-schema types.

Models write argument values as text (XML formats) or as JSON of the wrong type
("5" for an integer). Values are coerced to the first schema alternative they fit;
a value that fits none is kept as it was written, never dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from parsers.schema_types import Schema, alternatives

_INT = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_SCALARS = ("null", "boolean", "integer", "number")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    properties: Mapping[str, Schema] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    closed: bool = False  # additionalProperties: false; undeclared arguments are invalid

    def schema(self, key: str) -> Schema | None:
        return self.properties.get(key)

    def undeclared(self, key: str) -> bool:
        """An argument the schema forbids: not declared, and extras are not allowed."""
        return self.closed and key not in self.properties


@dataclass(frozen=True)
class ToolSet:
    """The tools a request declared, by name. Empty means: no tool parsing."""

    specs: Mapping[str, ToolSpec] = field(default_factory=dict)

    def get(self, name: str) -> ToolSpec | None:
        return self.specs.get(name)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def has_prefix(self, text: str) -> bool:
        """Whether some declared tool's name starts with `text`."""
        return any(name.startswith(text) for name in self.specs)

    @staticmethod
    def from_openai(tools: Sequence[Mapping[str, Any]] | None) -> ToolSet:
        """Reads OpenAI-shaped tools; the flat {"name", "parameters"} shape works too."""
        specs: dict[str, ToolSpec] = {}
        for tool in tools or ():
            fn = tool.get("function", tool)
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                continue
            params = fn.get("parameters") or fn.get("input_schema") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            req = params.get("required") if isinstance(params, Mapping) else None
            specs[fn["name"]] = ToolSpec(
                name=fn["name"],
                properties=dict(props) if isinstance(props, Mapping) else {},
                required=frozenset(r for r in req or () if isinstance(r, str)),
                closed=isinstance(params, Mapping) and params.get("additionalProperties") is False,
            )
        return ToolSet(specs)


def allows_string(schema: Schema | None) -> bool:
    return any(kind in (None, "string") for kind, _ in alternatives(schema))


def is_string_only(schema: Schema | None) -> bool:
    """True when text needs no parsing: the schema says string and nothing else."""
    kinds = {kind for kind, _ in alternatives(schema)}
    return kinds == {"string"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """Strict JSON: NaN and Infinity are refused, since they could not be sent on."""
    return json.loads(text, parse_constant=_reject_constant)


def _json_safe(value: Any, depth: int = 0) -> bool:
    if depth > 64:
        return False
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_json_safe(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_safe(v, depth + 1) for k, v in value.items())
    return False


def _literal(text: str) -> Any:
    """JSON, or a Python literal (models write {'a': 1} and True too); else the text."""
    try:
        return loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return value if _json_safe(value) else text


def _parse_as(kind: str, text: str) -> tuple[bool, Any]:
    t = text.strip()
    if kind == "null":
        return t.lower() in ("null", "none"), None
    if kind == "boolean":
        return t.lower() in ("true", "false"), t.lower() == "true"
    if kind in ("integer", "number"):
        if _INT.fullmatch(t) and len(t) < 4000:  # int() refuses longer digit strings
            return True, int(t)
        if not _NUMBER.fullmatch(t):
            return False, None
        num = float(t)
        if not math.isfinite(num):
            return False, None
        if kind == "integer":
            return num.is_integer(), int(num) if num.is_integer() else None
        return True, num
    if kind in ("object", "array"):
        value = _literal(t)
        return isinstance(value, dict if kind == "object" else list), value
    return False, None


def coerce_text(text: str, schema: Schema | None) -> Any:
    """A value written as text, converted to the first schema type it parses as."""
    alts = list(alternatives(schema))
    for kind, sub in sorted(alts, key=lambda a: a[0] in (None, "string")):
        if kind in (None, "string"):
            return text
        ok, value = _parse_as(kind, text)
        if ok:
            return coerce_value(value, sub)
    return text


def _fits(kind: str | None, value: Any) -> bool:
    if kind is None:
        return True
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    expected = {"string": str, "boolean": bool, "object": dict, "array": list}.get(kind)
    if kind == "null":
        return value is None
    return expected is not None and isinstance(value, expected)


def coerce_value(value: Any, schema: Schema | None) -> Any:
    """A JSON value made to fit the schema where it can be; nested values too."""
    alts = list(alternatives(schema))
    for kind, sub in alts:
        if _fits(kind, value):
            return _coerce_inside(value, sub)
    if isinstance(value, float) and value.is_integer() and any(k == "integer" for k, _ in alts):
        return int(value)
    if isinstance(value, str):
        return coerce_text(value, schema)
    if any(k == "string" for k, _ in alts) and isinstance(value, (int, float, bool)):
        return json.dumps(value)
    return value


def conforms(value: Any, schema: Schema | None, depth: int = 0) -> bool:
    """Whether a value (already coerced) has one of the schema's types, its declared
    properties and items too. Only types: enums, patterns and bounds are the client's
    to check."""
    if depth > 64:
        return True
    for kind, sub in alternatives(schema):
        if not _fits(kind, value):
            continue
        if isinstance(value, dict):
            props = sub.get("properties")
            if isinstance(props, Mapping) and not all(
                conforms(v, props[k], depth + 1) for k, v in value.items() if k in props
            ):
                continue
        elif isinstance(value, list):
            items = sub.get("items")
            if isinstance(items, Mapping) and not all(conforms(v, items, depth + 1) for v in value):
                continue
        return True
    return False


def _coerce_inside(value: Any, schema: Schema) -> Any:
    if isinstance(value, dict):
        props = schema.get("properties")
        if isinstance(props, Mapping):
            return {k: coerce_value(v, props.get(k)) if k in props else v for k, v in value.items()}
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            return [coerce_value(v, items) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def escape(text: str) -> str:
    """Text as the inside of a JSON string literal."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
