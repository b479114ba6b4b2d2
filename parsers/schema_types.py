"""The type alternatives of a JSON schema, as the parsers coerce argument values to
them (parsers/_schema.py). The call grammars (parsers/grammars) write values by the
same reading, so they share this one definition."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["Schema", "alternatives"]

Schema = Mapping[str, Any]


def alternatives(schema: Schema | None) -> Iterator[tuple[str | None, Schema]]:
    """(type name, subschema) for each alternative; None type means unconstrained."""
    if not isinstance(schema, Mapping):
        yield None, {}
        return
    subs = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(subs, Sequence) and not isinstance(subs, str):
        for sub in subs:
            yield from alternatives(sub)
        return
    kind = schema.get("type")
    if isinstance(kind, str):
        yield kind, schema
    elif isinstance(kind, Sequence) and kind:
        for k in kind:
            yield (k if isinstance(k, str) else None), schema
    elif "properties" in schema:
        yield "object", schema
    else:
        yield None, schema
