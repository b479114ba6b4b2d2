"""JSON schemas for constrained-decoding tests and benchmarks: a hand-written set that
covers the keywords structured output needs, and the tool parameter schemas of the real
clients' captured requests (shared/fixtures/clients).

`bounded(schema)` tightens a schema so that a random model, whose every step is close
to a uniform draw over the allowed tokens, finishes within a few hundred tokens: every
document valid for the tightened schema is valid for the original one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

FIXTURES_ENV = "MLX_GATEWAY_CLIENT_FIXTURES"

# two small tools' parameters whose every valid call a random model finishes quickly
WEATHER_TOOL_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_TOOL_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 10},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "age", "address"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": -10, "maximum": 10},
                "minItems": 2,
                "maxItems": 4,
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 5},
                "maxItems": 3,
            },
        },
        "required": ["scores", "tags"],
        "additionalProperties": False,
    },
    "enum_const": {
        "type": "object",
        "properties": {
            "kind": {"const": "event"},
            "level": {"enum": ["debug", "info", "warning", "error"]},
            "code": {"enum": [1, 2, 3, None, True]},
        },
        "required": ["kind", "level", "code"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer"},
                    {"type": "string", "maxLength": 6},
                    {"type": "null"},
                ]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "one_of": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"circle": {"type": "number", "minimum": 0}},
                "required": ["circle"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "w": {"type": "integer", "minimum": 1, "maximum": 99},
                    "h": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["w", "h"],
                "additionalProperties": False,
            },
        ]
    },
    "refs_defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "segment": {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
        "type": "object",
        "properties": {
            "path": {"type": "array", "items": {"$ref": "#/$defs/segment"}, "maxItems": 2}
        },
        "required": ["path"],
        "additionalProperties": False,
    },
    "patterns_formats": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
            "day": {"type": "string", "format": "date"},
            "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            "short": {"type": "string", "minLength": 2, "maxLength": 4},
        },
        "required": ["id", "day", "hex", "short"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 8},
            "count": {"type": "integer", "minimum": 0},
            "ratio": {"type": "number"},
            "done": {"type": "boolean"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "top_level_array": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 5,
    },
}


def fixtures_folder() -> Path | None:
    """shared/fixtures/clients in the checkout or next to it, or the folder named by $ENV."""
    root = Path(__file__).resolve().parents[2]
    candidates = [Path(os.environ[FIXTURES_ENV])] if os.environ.get(FIXTURES_ENV) else []
    candidates += [root / "shared/fixtures/clients", root.parent / "shared/fixtures/clients"]
    return next((f for f in candidates if f.is_dir() and any(f.glob("*.json"))), None)


def _tool_schemas(tools: list[Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, parameter schema) of every function tool in one request's tools, in
    whichever dialect's shape; Responses namespaces are walked into."""
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if isinstance(tool.get("function"), dict):
            fn = tool["function"]
            yield fn["name"], fn.get("parameters") or {"type": "object"}
        elif "input_schema" in tool:
            yield tool["name"], tool["input_schema"]
        elif tool.get("type") == "function":
            yield tool["name"], tool.get("parameters") or {"type": "object"}
        elif tool.get("type") == "namespace":
            yield from _tool_schemas(tool.get("tools") or [])


def client_tool_schemas(folder: Path | None = None) -> dict[str, dict[str, Any]]:
    """Every distinct tool parameter schema of the captured requests, named
    "<capture>:<tool>" after the first capture that declares it."""
    folder = folder or fixtures_folder()
    if folder is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    for path in sorted(folder.glob("*.json")):
        body = json.loads(path.read_text())
        for name, schema in _tool_schemas(body.get("tools") or []):
            key = json.dumps(schema, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out[f"{path.stem}:{name}"] = schema
    return out


def client_lark_grammars(folder: Path | None = None) -> dict[str, str]:
    """The Lark grammars of the captured requests' custom tools (Codex's apply_patch)."""
    folder = folder or fixtures_folder()
    out: dict[str, str] = {}
    for path in sorted(folder.glob("*.json")) if folder else ():
        for tool in json.loads(path.read_text()).get("tools") or []:
            fmt = tool.get("format") if isinstance(tool, dict) else None
            if isinstance(fmt, Mapping) and fmt.get("syntax") == "lark":
                out[f"{path.stem}:{tool['name']}"] = str(fmt["definition"])
    return out


# -- tightening for random models ---------------------------------------------------------

_STRING_CAP = 6
_FORMAT_CAP = 40
_OPEN_FORMATS = frozenset({"uri", "uri-reference", "iri", "email", "hostname", "idn-email"})
_ITEMS_CAP = 2
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "not", "additionalItems", "if", "then", "else")


def bounded(schema: Any) -> Any:
    """A copy of `schema` a random model finishes quickly: free strings get a short
    maxLength, arrays at most two items, objects no properties beyond the declared ones,
    and optional properties are dropped from objects that declare many. Each change only
    narrows the set of valid documents."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded(v) for v in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = bounded(out[key])
    types = out.get("type")
    kinds = set(types) if isinstance(types, list) else {types}
    free = not any(k in out for k in ("enum", "const", "pattern"))
    if "string" in kinds and free:
        fmt = out.get("format")
        if fmt is None:
            out["maxLength"] = _cap(out, "minLength", "maxLength", _STRING_CAP)
        elif fmt in _OPEN_FORMATS:  # a URI or an address can run on: bound it too
            out["maxLength"] = _cap(out, "minLength", "maxLength", _FORMAT_CAP)
    if "array" in kinds or "items" in out:
        out["maxItems"] = _cap(out, "minItems", "maxItems", _ITEMS_CAP)
    if "object" in kinds or "properties" in out:
        _bound_object(out)
    return out


def _cap(schema: dict[str, Any], low: str, high: str, cap: int) -> int:
    return max(int(schema.get(low, 0)), min(int(schema.get(high, cap)), cap))


def _bound_object(out: dict[str, Any]) -> None:
    given = out.get("properties")
    props: dict[str, Any] = given if isinstance(given, dict) else {}
    required = [r for r in out.get("required") or () if isinstance(r, str)]
    if not all(r in props for r in required):
        return  # a required name only a pattern admits: leave the object open
    # keep every required property and the first two optional ones, nothing else
    optional = [k for k in props if k not in required][:2]
    out["properties"] = {k: v for k, v in props.items() if k in required or k in optional}
    out["additionalProperties"] = False
    out.pop("patternProperties", None)


def hermes_calls(text: str, tools: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, arguments text) of each call the hermes parser reads in `text`."""
    import parsers
    from parsers.events import ToolCallArgs, ToolCallStart

    parser = parsers.create("hermes", tools=tools, think=False)
    events = parser.feed(text) + parser.finish()
    return [
        (start.name, "".join(
            e.fragment for e in events if isinstance(e, ToolCallArgs) and e.index == start.index
        ))
        for start in events
        if isinstance(start, ToolCallStart)
    ]  # fmt: skip
