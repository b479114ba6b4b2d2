"""Bounds on what one request controls (gateway/core/limits.py): stop strings, body
nesting, messages and tools, schema and grammar sizes, and the regex a tool's grammar
flattens into. Each over-limit request is a 400 in its route's dialect naming the limit,
and the server goes on serving. Where the bound is on work or memory, the test measures
memory (tracemalloc traces the server's threads too), never time.

The live server runs the tiny random Qwen3 (hermes tool calls: a string argument's
`x-grammar` is flattened into a regex there); nothing here depends on what it writes."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from gateway.core import http
from gateway.core.limits import (
    MAX_GRAMMAR_CHARS,
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_SCHEMA_BYTES,
    MAX_STOP_CHARS,
    MAX_STOP_TOTAL_CHARS,
    MAX_TOOLS,
)
from gateway.core.models.build import build_served
from gateway.openai.wire import ChatCompletionRequest
from parsers.grammars import MAX_REGEX_CHARS
from tests.support.anthropic_checks import check_error
from tests.support.live_server import live_server
from tests.support.openai_checks import error_of, post

MODEL = "tiny-qwen3"
HELLO = [{"role": "user", "content": "Hi"}]
CHAT, COMPLETIONS, RESPONSES, MESSAGES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
)
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def base_url(tiny_qwen3_dir: Path) -> Iterator[str]:
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=MODEL)) as url:
        yield url


def _body(route: str, **extra: Any) -> dict[str, Any]:
    """A small valid request for `route`, with `extra` fields."""
    if route == COMPLETIONS:
        return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **extra}
    if route == RESPONSES:
        return {"model": MODEL, "input": "Hi", "max_output_tokens": 1, **extra}
    return {"model": MODEL, "messages": HELLO, "max_tokens": 1, **extra}


def _refused(r: httpx.Response, route: str) -> str:
    """The 400's message, checked to be in the route's dialect."""
    if route == MESSAGES:
        assert r.status_code == 400, r.text
        return check_error(r.json(), "invalid_request_error")
    return str(error_of(r, 400)["message"])


def _still_serving(base_url: str, route: str) -> None:
    r = post(base_url, route, _body(route))
    assert r.status_code == 200, r.text


# -- stop strings ----------------------------------------------------------------------------

STOP_ROUTES = [(CHAT, "stop"), (COMPLETIONS, "stop"), (MESSAGES, "stop_sequences")]


@pytest.mark.parametrize(("route", "field"), STOP_ROUTES)
def test_a_stop_string_over_the_length_limit_is_a_400(
    base_url: str, route: str, field: str
) -> None:
    ok = post(base_url, route, _body(route, **{field: ["x" * MAX_STOP_CHARS]}))
    assert ok.status_code == 200, ok.text
    r = post(base_url, route, _body(route, **{field: ["x" * (MAX_STOP_CHARS + 1)]}))
    message = _refused(r, route)
    assert str(MAX_STOP_CHARS) in message and field in message
    _still_serving(base_url, route)


@pytest.mark.parametrize(("route", "field"), STOP_ROUTES)
def test_stop_strings_over_the_total_limit_are_a_400(base_url: str, route: str, field: str) -> None:
    each = MAX_STOP_TOTAL_CHARS // 12 + 1  # 12 of them pass the total, each short enough
    assert each <= MAX_STOP_CHARS
    stops = [f"{i:02}" + "y" * (each - 2) for i in range(12)]
    r = post(base_url, route, _body(route, **{field: stops}))
    assert str(MAX_STOP_TOTAL_CHARS) in _refused(r, route)
    _still_serving(base_url, route)


# -- the body: nesting, unpaired surrogates, the work its check does ------------------------------


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("route", [CHAT, RESPONSES, MESSAGES])
def test_a_body_nested_over_the_depth_limit_is_a_400(base_url: str, route: str) -> None:
    # the body object is one level: `extra` then holds the rest
    ok = post(base_url, route, _body(route, extra=_nested(MAX_JSON_DEPTH - 1)))
    assert ok.status_code == 200, ok.text
    r = post(base_url, route, _body(route, extra=_nested(MAX_JSON_DEPTH)))
    assert f"more than {MAX_JSON_DEPTH} levels" in _refused(r, route)
    _still_serving(base_url, route)


@pytest.mark.parametrize("route", [CHAT, MESSAGES])
def test_an_unpaired_surrogate_in_a_key_is_a_400(base_url: str, route: str) -> None:
    params = {"type": "object", "properties": {"ci\\ud800ty": {"type": "string"}}}
    if route == CHAT:
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    else:
        tools = [{"name": "f", "input_schema": params}]
    text = json.dumps(_body(route, tools=tools)).replace("\\\\ud800", "\\ud800")
    r = post(base_url, route, text.encode())
    assert "unpaired UTF-16 surrogate" in _refused(r, route)
    _still_serving(base_url, route)


def _request(body: bytes) -> Request:
    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": [], "app": SimpleNamespace(state=SimpleNamespace())}  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


def _traced_peak(run: Any) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_checking_a_large_flat_body_takes_memory_for_its_depth_not_its_size() -> None:
    """A 2 MB flat array (a million elements): reading it costs what parsing it does,
    plus the body's bytes, plus under 1 MB whatever its size (a path string per element
    took about 120 MB)."""
    body = ("[" + ",".join(["0"] * 1_000_000) + "]").encode()
    parse_only = _traced_peak(lambda: json.loads(body))
    read = _traced_peak(lambda: asyncio.run(http.read_json(_request(body))))
    assert read < parse_only + len(body) + 1 * MiB, (read, parse_only)


def test_large_bodies_are_parsed_and_validated_off_the_event_loop(
    base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, bool]] = []

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    loads, validate = json.loads, ChatCompletionRequest.model_validate

    def traced_loads(s: Any, *args: Any, **kwargs: Any) -> Any:
        if len(s) > http.INLINE_BODY_BYTES:
            seen.append(("parse", on_loop()))
        return loads(s, *args, **kwargs)

    def traced_validate(obj: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(("validate", on_loop()))
        return validate(obj, *args, **kwargs)

    monkeypatch.setattr(json, "loads", traced_loads)
    monkeypatch.setattr(ChatCompletionRequest, "model_validate", traced_validate)
    big = [{"role": "user", "content": "x" * (2 * http.INLINE_BODY_BYTES)}]
    r = post(base_url, CHAT, _body(CHAT, messages=big))
    assert r.status_code == 200, r.text
    assert seen == [("parse", False), ("validate", False)]


# -- counts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "field"), [(CHAT, "messages"), (MESSAGES, "messages"), (RESPONSES, "input")])  # fmt: skip
def test_too_many_messages_are_a_400(base_url: str, route: str, field: str) -> None:
    turns = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    r = post(base_url, route, _body(route, **{field: turns}))
    message = _refused(r, route)
    assert str(MAX_MESSAGES) in message and field in message
    _still_serving(base_url, route)


def _tools(route: str, schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if route == MESSAGES:
        return [{"name": f"t{i}", "input_schema": s} for i, s in enumerate(schemas)]
    if route == RESPONSES:
        return [{"type": "function", "name": f"t{i}", "parameters": s} for i, s in enumerate(schemas)]  # fmt: skip
    return [{"type": "function", "function": {"name": f"t{i}", "parameters": s}} for i, s in enumerate(schemas)]  # fmt: skip


@pytest.mark.parametrize("route", [CHAT, RESPONSES, MESSAGES])
def test_too_many_tools_are_a_400(base_url: str, route: str) -> None:
    tools = _tools(route, [{"type": "object"}] * (MAX_TOOLS + 1))
    r = post(base_url, route, _body(route, tools=tools))
    assert str(MAX_TOOLS) in _refused(r, route)
    _still_serving(base_url, route)


# -- schema and grammar sizes ----------------------------------------------------------------------

BIG_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "description": "d" * 200} for i in range(1400)},
}


@pytest.mark.parametrize("route", [CHAT, RESPONSES, MESSAGES])
def test_a_tool_schema_over_the_size_limit_is_a_400(base_url: str, route: str) -> None:
    assert len(json.dumps(BIG_SCHEMA)) > MAX_SCHEMA_BYTES
    r = post(base_url, route, _body(route, tools=_tools(route, [BIG_SCHEMA])))
    message = _refused(r, route)
    assert str(MAX_SCHEMA_BYTES) in message and "'t0'" in message
    _still_serving(base_url, route)


def test_a_response_format_schema_over_the_size_limit_is_a_400(base_url: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}
    r = post(base_url, CHAT, _body(CHAT, response_format=fmt))
    assert str(MAX_SCHEMA_BYTES) in _refused(r, CHAT)
    _still_serving(base_url, CHAT)


def test_a_custom_tool_grammar_over_the_size_limit_is_a_400(base_url: str) -> None:
    definition = 'start: "a"\n' + "// filler\n" * (MAX_GRAMMAR_CHARS // 10)
    tool = {"type": "custom", "name": "g", "format": {"type": "grammar", "definition": definition}}
    r = post(base_url, RESPONSES, _body(RESPONSES, tools=[tool]))
    assert str(MAX_GRAMMAR_CHARS) in _refused(r, RESPONSES)
    _still_serving(base_url, RESPONSES)


def doubling_grammar(levels: int) -> str:
    """Each rule uses the next twice: 2**levels copies of the last once flattened (24
    levels: 17 million characters; 30: a billion)."""
    rules = [f"r{i}: r{i + 1} r{i + 1}" for i in range(levels)]
    return "\n".join(["start: r0", *rules, f'r{levels}: "ab"', ""])


def _grammar_tool(route: str, grammar: str) -> dict[str, Any]:
    if route == RESPONSES:  # a custom tool: its input follows the grammar
        fmt = {"type": "grammar", "syntax": "lark", "definition": grammar}
        return {"type": "custom", "name": "patch", "format": fmt}
    annotated = {"type": "string", "x-grammar": {"syntax": "lark", "definition": grammar}}
    schema = {"type": "object", "properties": {"patch": annotated}, "required": ["patch"]}
    if route == MESSAGES:
        return {"name": "patch", "input_schema": schema}
    return {"type": "function", "function": {"name": "patch", "parameters": schema}}


@pytest.mark.parametrize("route", [CHAT, RESPONSES, MESSAGES])
def test_a_doubling_grammar_is_refused_while_it_expands(base_url: str, route: str) -> None:
    tools = [_grammar_tool(route, doubling_grammar(24))]
    peak = _traced_peak(lambda: post(base_url, route, _body(route, tools=tools)))
    # flattened whole, the regex alone was 17 MB of text, and about 500 MB traced
    assert peak < 16 * MiB, peak
    r = post(base_url, route, _body(route, tools=tools))
    message = _refused(r, route)
    assert str(MAX_REGEX_CHARS) in message and "'patch'" in message
    _still_serving(base_url, route)
