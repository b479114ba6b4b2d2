"""Bounds on what one request controls. Each protects the server (memory, or work done
on the engine thread, the event loop or a worker thread) and sits well above what the
real clients send (shared/fixtures/clients: at most 24 tools, 21 KB for the largest tool
schema, bodies 12 levels deep, no stop strings). Going over one is a 400 in the client's
dialect that names the limit and what to change.

The body's size has its own bound (ServerSettings.max_body_bytes, a 413); the flattened
regex of a tool's custom grammar is bounded where it is built
(parsers.grammars.MAX_REGEX_CHARS), while it is built.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.core.errors import InvalidRequest

# Each choice builds a character trie over its stop strings on the engine thread.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # one stop string
MAX_STOP_TOTAL_CHARS = 4096  # all of a request's stop strings together
# Nesting of the request body (objects and arrays); serde_json, which llguidance reads
# schemas with, stops at 128.
MAX_JSON_DEPTH = 64
MAX_MESSAGES = 10_000  # messages (Responses: input items) in one request
MAX_TOOLS = 1024  # OpenAI allows 128; clients with many MCP servers send more
# One JSON schema as sent (a response format, a tool's parameters), serialized:
# llguidance's compile time grows faster than linearly with its size.
MAX_SCHEMA_BYTES = 256 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024  # a custom tool's grammar definition (Codex's: 578)


def check_count(items: Sequence[Any], limit: int, *, param: str, what: str) -> None:
    """At most `limit` `what` (a plural noun) in `items`, sent at `param`."""
    if len(items) > limit:
        raise InvalidRequest(
            f"{param} holds {len(items)} {what}; this server accepts at most {limit} in "
            "one request: send fewer",
            param=param,
            code="too_many_items",
        )


def check_stops(items: Sequence[str], *, param: str) -> None:
    check_count(items, MAX_STOP_STRINGS, param=param, what="stop strings")
    for i, stop in enumerate(items):
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"{param}[{i}] is {len(stop)} characters long; a stop string may be at most "
                f"{MAX_STOP_CHARS}: send a shorter one",
                param=f"{param}[{i}]",
                code="stop_too_long",
            )
    total = sum(len(s) for s in items)
    if total > MAX_STOP_TOTAL_CHARS:
        raise InvalidRequest(
            f"{param} holds {total} characters of stop strings; at most "
            f"{MAX_STOP_TOTAL_CHARS} in all are accepted: send fewer or shorter ones",
            param=param,
            code="stop_too_long",
        )


def check_schema_size(schema: Any, *, param: str, what: str | None = None) -> None:
    """A JSON schema sent at `param` (`what` names it in the message) is at most
    MAX_SCHEMA_BYTES once serialized."""
    size = len(json.dumps(schema, ensure_ascii=False).encode())
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"{what or param} is a schema of {size} bytes; this server compiles schemas of at most "
            f"{MAX_SCHEMA_BYTES} bytes: send a smaller one (shared parts as $defs, shorter "
            "descriptions)",
            param=param,
            code="schema_too_large",
        )


def check_grammar_size(definition: str, *, param: str) -> None:
    if len(definition) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(
            f"{param} is a grammar of {len(definition)} characters; this server accepts at "
            f"most {MAX_GRAMMAR_CHARS}: send a smaller one",
            param=param,
            code="grammar_too_large",
        )
