"""The oracle of the soak: every body, every stream event and every error is checked
against the official SDKs' types (openai, anthropic), plus the rules the types cannot
say (event order, deltas adding up to the final message, tool calls naming a tool with
JSON arguments, structured output matching its schema). A failed check raises
`Invalid`; the client that made the request records it.

The chat and Anthropic checks are the test suite's own (tests/support/openai_checks.py,
tests/support/anthropic_checks.py); the Responses checks are a compact form of
tests/gateway/openai/test_responses.py's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
from anthropic.types import Message
from anthropic.types.shared import ErrorResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from tests.support.anthropic_checks import EVENT, Events, check_message, check_stream
from tests.support.openai_checks import SSE, chat_chunks, chat_texts
from tests.support.soak.prompts import SCHEMA, TOOL_NAMES

RESPONSE_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# what a check may raise when a body is wrong
FAILURES = (AssertionError, ValidationError, ValueError, KeyError, TypeError, IndexError)


class Invalid(Exception):
    """A response that breaks its dialect's contract."""


def ensure(ok: object, why: str) -> None:
    if not ok:
        raise Invalid(why)


# -- errors --------------------------------------------------------------------------------


def error_body(r: httpx.Response, dialect: str) -> str:
    """Check a non-2xx answer is its dialect's error JSON (and carries Retry-After where
    it asks the client to come back); return its message."""
    try:
        body = r.json()
    except ValueError:
        raise Invalid(f"{r.status_code} with a body that is not JSON: {r.text[:200]!r}") from None
    if r.status_code in (429, 503):
        ensure(int(r.headers.get("retry-after", "0")) >= 1, f"{r.status_code} without Retry-After")
    if dialect == "anthropic":
        err = ErrorResponse.model_validate(body)
        want = ANTHROPIC_TYPES.get(r.status_code)
        ensure(err.type == "error" and err.error.message, f"bad Anthropic error {body}")
        ensure(want is None or err.error.type == want, f"{r.status_code} typed {err.error.type}")
        return err.error.message
    err_obj = body.get("error") if isinstance(body, dict) else None
    ensure(isinstance(err_obj, dict), f"no error object in {body}")
    assert isinstance(err_obj, dict)
    ensure(set(err_obj) >= {"message", "type", "param", "code"}, f"error fields {sorted(err_obj)}")
    ensure(isinstance(err_obj["message"], str) and err_obj["message"], "an empty error message")
    ensure(isinstance(err_obj["type"], str) and err_obj["type"], "an empty error type")
    return str(err_obj["message"])


# -- server-sent events --------------------------------------------------------------------


@dataclass
class Stream:
    """A stream's events as read: (event name or None, raw data)."""

    items: list[tuple[str | None, str]] = field(default_factory=list)
    complete: bool = False  # read to its end (not cut by the client)


def read_stream(r: httpx.Response, limit: int | None = None) -> Stream:
    """Read SSE lines until the end, or until `limit` data lines (then stop reading: the
    caller closes the connection, as a client that gives up would)."""
    out = Stream()
    name: str | None = None
    for line in r.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            out.items.append((name, line[5:].strip()))
            name = None
            if limit is not None and len(out.items) >= limit:
                return out
    out.complete = True
    return out


def _data(stream: Stream) -> Iterator[tuple[str | None, dict[str, Any]]]:
    for name, raw in stream.items:
        if raw != "[DONE]":
            yield name, json.loads(raw)


# -- OpenAI chat -----------------------------------------------------------------------------


def chat_body(body: Any, n: int = 1) -> ChatCompletion:
    chat = ChatCompletion.model_validate(body)
    ensure(chat.object == "chat.completion", f"object {chat.object}")
    ensure(sorted(c.index for c in chat.choices) == list(range(n)), "choice indexes")
    for choice in chat.choices:
        check_calls(
            choice.finish_reason,
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
             if c.type == "function"],
        )  # fmt: skip
    return chat


def chat_stream(stream: Stream, n: int = 1) -> list[ChatCompletionChunk]:
    """A whole stream: every chunk typed, [DONE] last, each choice's role first and
    finish_reason last, and its tool calls whole."""
    ensure(stream.items and stream.items[-1][1] == "[DONE]", "no [DONE] at the end")
    ensure(sum(raw == "[DONE]" for _, raw in stream.items) == 1, "data after [DONE]")
    sse = SSE(200, data=[d for _, d in _data(stream)], done=True)
    chunks = chat_chunks(sse)
    texts = chat_texts(chunks)
    ensure(sorted(texts) == list(range(n)), f"choices {sorted(texts)}, asked {n}")
    calls: dict[tuple[int, int], list[str]] = {}
    finish: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                got = calls.setdefault((choice.index, call.index), ["", ""])
                if call.function is not None:
                    got[0] += call.function.name or ""
                    got[1] += call.function.arguments or ""
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    for i in texts:
        check_calls(finish.get(i), [(a, b) for (c, _), (a, b) in sorted(calls.items()) if c == i])
    return chunks


def chat_partial(stream: Stream) -> None:
    """The chunks a client read before it left: each one typed."""
    for _, data in _data(stream):
        ChatCompletionChunk.model_validate(data)


def check_calls(finish: str | None, calls: list[tuple[str, str]]) -> None:
    """Calls that ended (finish_reason tool_calls) name a tool and carry a JSON object."""
    if finish != "tool_calls":
        return
    ensure(calls, "finish_reason tool_calls without a call")
    for name, arguments in calls:
        ensure(name in TOOL_NAMES, f"a call to {name!r}, not one of the tools")
        ensure(isinstance(json.loads(arguments), dict), f"arguments {arguments!r}")


def structured(content: str | None, finish: str | None) -> bool:
    """Finished output matches the schema (True); output cut by max_tokens is not
    checked (False)."""
    if finish != "stop":
        return False
    jsonschema.validate(json.loads(content or ""), SCHEMA)
    return True


# -- Anthropic -------------------------------------------------------------------------------


def anthropic_events(stream: Stream) -> Events:
    events = Events(200)
    for name, data in _data(stream):
        ensure(name is not None, "a data line without an event line")
        assert name is not None
        events.items.append((name, data))
    return events


def message_body(body: Any) -> Message:
    msg = check_message(body)
    _tool_use(msg)
    return msg


def message_stream(stream: Stream) -> Message:
    msg = check_stream(anthropic_events(stream))
    _tool_use(msg)
    return msg


def message_partial(stream: Stream) -> None:
    for name, data in anthropic_events(stream).items:
        ensure(data.get("type") == name, f"event {name} holds {data.get('type')}")
        if name != "ping":
            EVENT.validate_python(data)


def _tool_use(msg: Message) -> None:
    for block in msg.content:
        if block.type == "tool_use":
            ensure(block.name in TOOL_NAMES, f"a tool_use of {block.name!r}")
    if msg.stop_reason == "tool_use":
        ensure(any(b.type == "tool_use" for b in msg.content), "tool_use without a block")


# -- Responses -------------------------------------------------------------------------------


def response_body(body: Any) -> Response:
    resp = Response.model_validate(body)
    ensure(resp.object == "response" and resp.id.startswith("resp_"), f"id {resp.id}")
    ensure(resp.status in ("completed", "incomplete"), f"status {resp.status}")
    return resp


def response_stream(stream: Stream) -> Response:
    """Every event typed and named, numbered in order, the terminal one last, and the
    text deltas adding up to the final response's text."""
    events = response_partial(stream)
    ensure(stream.complete and events, "the stream ended early")
    ensure(events[-1]["type"] in TERMINAL, f"last event {events[-1]['type']}")
    ensure(all(e["type"] not in TERMINAL for e in events[:-1]), "a terminal event midway")
    kinds = [e["type"] for e in events[:2]]
    ensure(kinds == ["response.created", "response.in_progress"], f"opened with {kinds}")
    final = response_body(events[-1]["response"])
    for item in final.output:
        if item.type == "message":
            said = "".join(p.text for p in item.content if p.type == "output_text")
            streamed = "".join(
                e["delta"] for e in events
                if e["type"] == "response.output_text.delta" and e["item_id"] == item.id
            )  # fmt: skip
            ensure(said == streamed, "text deltas do not add up to the final text")
    return final


def response_partial(stream: Stream) -> list[dict[str, Any]]:
    events = []
    for name, data in _data(stream):
        ensure(data.get("type") == name, f"event {name} holds {data.get('type')}")
        RESPONSE_EVENT.validate_python(data)
        events.append(data)
    numbers = [e["sequence_number"] for e in events]
    ensure(numbers == list(range(len(numbers))), "sequence numbers out of order")
    return events
