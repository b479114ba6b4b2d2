"""Helpers for Anthropic Messages tests: named-event SSE reading, and the Anthropic
SDK's own types as the oracle for every body, event and error."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from gateway.anthropic.emit import thinking_from_signature

TIMEOUT = 300.0
EVENT = TypeAdapter(RawMessageStreamEvent)


MODEL = "tiny-qwen3"
HELLO: Any = [{"role": "user", "content": "hi"}]
WEATHER: Any = {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
        "required": ["city"],
    },
}


@dataclass
class Events:
    """A stream's events in order: (event name, JSON payload)."""

    status: int
    items: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    body: str = ""

    def named(self, name: str) -> list[dict[str, Any]]:
        return [data for event, data in self.items if event == name]

    @property
    def names(self) -> list[str]:
        return [event for event, _ in self.items]


def read_events(
    base_url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/v1/messages",
    *,
    on_line: Callable[[str], None] | None = None,
) -> Events:
    """POST with stream: true and read every named event; `on_line` sees each line as it
    arrives, so a test can act mid-stream."""
    with httpx.stream(
        "POST",
        f"{base_url}{path}",
        json={**body, "stream": True},
        headers=headers,
        timeout=TIMEOUT,
    ) as r:
        out = Events(r.status_code)
        if r.status_code != 200:
            out.body = r.read().decode()
            return out
        assert r.headers["content-type"].startswith("text/event-stream")
        name: str | None = None
        for line in r.iter_lines():
            if on_line is not None:
                on_line(line)
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                assert name is not None, "a data line without an event line"
                out.items.append((name, json.loads(line[5:])))
                name = None
    return out


def check_error(body: dict[str, Any], kind: str) -> str:
    """An Anthropic error body of type `kind`; returns its message."""
    err = ErrorResponse.model_validate(body)
    assert err.type == "error" and err.error.type == kind, body
    assert err.error.message
    return err.error.message


def check_stream(events: Events) -> Message:
    """Validate every event with the SDK's types and Anthropic's ordering rules, and
    rebuild the message the stream adds up to (validated as a Message)."""
    assert events.status == 200, events.body
    assert events.names[0] == "message_start" and events.names[-1] == "message_stop"
    message: dict[str, Any] | None = None
    open_index: int | None = None
    partial: dict[int, str] = {}
    for name, data in events.items:
        assert data.get("type") == name, (name, data)
        if name == "ping":
            assert data == {"type": "ping"}
            continue
        assert name != "error", data
        event = EVENT.validate_python(data)
        if event.type == "message_start":
            assert message is None
            message = event.message.model_dump()
            continue
        assert message is not None
        if event.type == "content_block_start":
            assert open_index is None, "a block opened before the previous one closed"
            assert event.index == len(message["content"])
            open_index = event.index
            message["content"].append(event.content_block.model_dump())
        elif event.type == "content_block_delta":
            assert event.index == open_index
            _apply(message["content"][event.index], event.delta.model_dump(), partial, event.index)
        elif event.type == "content_block_stop":
            assert event.index == open_index
            block = message["content"][event.index]
            if block["type"] == "thinking":
                assert block["signature"], "a thinking block closed without a signature"
            if block["type"] == "tool_use":
                block["input"] = json.loads(partial.get(event.index) or "{}")
            open_index = None
        elif event.type == "message_delta":
            assert open_index is None
            message.update(event.delta.model_dump(include={"stop_reason", "stop_sequence"}))
            message["usage"].update(event.usage.model_dump(exclude_none=True))
    assert message is not None and message["stop_reason"] is not None
    return Message.model_validate(message)


def _apply(block: dict[str, Any], delta: dict[str, Any], partial: dict[int, str], i: int) -> None:
    kind = delta["type"]
    if kind == "text_delta":
        assert block["type"] == "text"
        block["text"] += delta["text"]
    elif kind == "thinking_delta":
        assert block["type"] == "thinking" and not block["signature"], "thinking after signature"
        block["thinking"] += delta["thinking"]
    elif kind == "signature_delta":
        assert block["type"] == "thinking"
        block["signature"] = delta["signature"]
    elif kind == "input_json_delta":
        assert block["type"] == "tool_use"
        partial[i] = partial.get(i, "") + delta["partial_json"]
    else:
        raise AssertionError(f"unexpected delta {kind}")


def check_message(body: dict[str, Any]) -> Message:
    """A non-streamed body: the SDK's Message, with Anthropic-style ids and our
    signatures carrying each thinking block's text."""
    msg = Message.model_validate(body)
    assert msg.id.startswith("msg_") and msg.role == "assistant"
    check_blocks(msg)
    return msg


def check_blocks(msg: Message) -> None:
    for block in msg.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_") and isinstance(block.input, dict)
        if block.type == "thinking":
            assert thinking_from_signature(block.signature) == block.thinking
