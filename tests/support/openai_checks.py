"""Helpers for end-to-end gateway tests: requests, SSE parsing, and the OpenAI SDK's types
as the oracle for every body and chunk."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

TIMEOUT = 120.0


def post(
    base_url: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    sent = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{base_url}{path}", content=data, headers=sent, timeout=TIMEOUT)


@dataclass
class SSE:
    status: int
    data: list[dict[str, Any]] = field(default_factory=list)  # JSON payloads, in order
    comments: list[str] = field(default_factory=list)
    comments_before_data: int = 0  # comments seen before the first data line after the role chunk
    done: bool = False
    body: str = ""

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [d for d in self.data if "error" in d]


def stream(
    base_url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    on_line: Callable[[str], None] | None = None,
) -> SSE:
    """POST with stream: true and read every SSE line; asserts nothing follows [DONE].
    `on_line` sees each line as it arrives, so a test can act mid-stream (open the gate
    a fake engine waits on once it has read the keepalives it expects)."""
    with httpx.stream(
        "POST", f"{base_url}{path}", json={**body, "stream": True}, headers=headers, timeout=TIMEOUT
    ) as r:
        out = SSE(r.status_code)
        if r.status_code != 200:
            out.body = r.read().decode()
            return out
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if on_line is not None:
                on_line(line)
            if line.startswith(":"):
                out.comments.append(line)
                if len(out.data) <= 1:
                    out.comments_before_data += 1
                continue
            if not line.startswith("data:"):
                continue
            assert not out.done, "data after [DONE]"
            payload = line[5:].strip()
            if payload == "[DONE]":
                out.done = True
                continue
            out.data.append(json.loads(payload))
    return out


def open_after(gate: threading.Event, count: int, prefix: str = ":") -> Callable[[str], None]:
    """An `on_line` that sets `gate` once it has read `count` lines starting with `prefix`
    (":" is an SSE comment, the OpenAI dialects' keepalive; "event: ping" Anthropic's)."""
    seen = 0

    def on_line(line: str) -> None:
        nonlocal seen
        if line.startswith(prefix):
            seen += 1
            if seen >= count:
                gate.set()

    return on_line


def chat_body(r: httpx.Response) -> ChatCompletion:
    assert r.status_code == 200, r.text
    body = ChatCompletion.model_validate(r.json())
    assert body.object == "chat.completion"
    return body


def chat_chunks(sse: SSE) -> list[ChatCompletionChunk]:
    assert sse.status == 200, sse.body
    assert sse.done, "the stream did not end with [DONE]"
    assert not sse.errors, sse.errors
    return [ChatCompletionChunk.model_validate(d) for d in sse.data]


def completion_body(r: httpx.Response) -> Completion:
    assert r.status_code == 200, r.text
    return Completion.model_validate(r.json())


def completion_chunks(sse: SSE) -> list[Completion]:
    assert sse.status == 200, sse.body
    assert sse.done and not sse.errors, sse.errors
    out = []
    for data in sse.data:
        # The API streams finish_reason null until a choice ends, but the SDK types it as
        # non-null (the SDK builds stream chunks without validating): check the rest
        # strictly, and that null is the only liberty taken.
        choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in data["choices"]]
        chunk = Completion.model_validate({**data, "choices": choices})
        for choice, raw in zip(chunk.choices, data["choices"], strict=True):
            if raw["finish_reason"] is None:
                choice.finish_reason = None  # type: ignore[assignment]
        out.append(chunk)
    return out


def chat_texts(chunks: list[ChatCompletionChunk]) -> dict[int, str]:
    """Content per choice index, checking each index gets one role chunk first and one
    finish_reason last."""
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in chunks:
        for choice in chunk.choices:
            i = choice.index
            assert i not in finished, f"choice {i} continued after its finish_reason"
            if i not in texts:
                assert choice.delta.role == "assistant", "a choice's first chunk names the role"
                texts[i] = ""
            texts[i] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(i)
    assert finished == set(texts), "every choice ends with a finish_reason"
    return texts


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """OpenAI's error JSON with a message; returns the inner error object."""
    assert r.status_code == status, (r.status_code, r.text)
    err: dict[str, Any] = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err
