"""Helpers for tests of speculative decoding over the wire: how many tokens a server
drafted and kept (its /metrics counters, moved by each request before its last byte
is sent), and a stream's events folded into what a client can see, so that a stream
written with drafts can be compared with one written without them.

Drafts change how tokens are grouped into chunks (several accepted tokens arrive in
one step), never what the chunks add up to, in what order, under which field: the
traces keep the order of every field change and join only what follows within one
field. A drafted-but-rejected token that reached the parser shows up as extra text,
an early or late switch between reasoning and content, or a tool call that was never
written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from anthropic.types import Message
from openai.types.chat import ChatCompletionChunk

from gateway.core.models.served import ServedModel
from tests.support.anthropic_checks import check_message, check_stream, read_events
from tests.support.openai_checks import post

DRAFTED = "mlx_gateway_speculative_drafted_tokens_total"
ACCEPTED = "mlx_gateway_speculative_accepted_tokens_total"


@dataclass(frozen=True)
class Drafts:
    drafted: int
    accepted: int

    def __sub__(self, before: Drafts) -> Drafts:
        return Drafts(self.drafted - before.drafted, self.accepted - before.accepted)

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted


def drafts(base_url: str) -> Drafts:
    """The server's drafted and accepted token counters."""
    r = httpx.get(f"{base_url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    values = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in (DRAFTED, ACCEPTED):
            values[name] = int(float(value))
    return Drafts(values[DRAFTED], values[ACCEPTED])


def pin_draft_costs(served: ServedModel) -> None:
    """Drafting follows its measured cost (a verify step against a plain one), and on a
    tiny model, or on a machine other tests keep busy, a step is mostly Python and
    timing noise: pin the cost model (as tests/runtime/batch/test_speculative.py does),
    so that rows draft whatever the timings."""
    assert served.runner is not None
    stats = served.runner.scheduler.speculation.stats
    stats.ratio, stats.sync, stats.measure = 0.1, 0.0, False


Trace = list[tuple[Any, ...]]


def _add(trace: Trace, key: tuple[Any, ...], text: str) -> None:
    """Join `text` to the last entry when it has the same key, else start a new one."""
    if not text:
        return
    if trace and trace[-1][:-1] == key:
        trace[-1] = (*key, trace[-1][-1] + text)
    else:
        trace.append((*key, text))


def chat_trace(chunks: list[ChatCompletionChunk]) -> Trace:
    """One choice's stream: reasoning and content text, tool calls (index, name, the
    arguments' pieces joined), the finish reason and the usage, in order; call ids left
    out (they are random)."""
    trace: Trace = []
    for chunk in chunks:
        if chunk.usage is not None:
            details = chunk.usage.completion_tokens_details
            reasoning = details.reasoning_tokens if details is not None else None
            trace.append(("usage", chunk.usage.completion_tokens, reasoning))
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            _add(trace, ("reasoning",), extra.get("reasoning_content") or "")
            _add(trace, ("content",), delta.content or "")
            for call in delta.tool_calls or []:
                function = call.function
                if function is not None and function.name:
                    trace.append(("call", call.index, function.name))
                if function is not None:
                    _add(trace, ("arguments", call.index), function.arguments or "")
            if choice.finish_reason is not None:
                trace.append(("finish", choice.finish_reason))
    return trace


def message_trace(items: list[tuple[str, dict[str, Any]]]) -> Trace:
    """An Anthropic stream's events: each block's start (its type, a tool's name), its
    deltas joined by kind (signatures kept: they carry the thinking text), its stop, and
    the stop reason with the output tokens; ids and pings left out."""
    trace: Trace = []
    for name, data in items:
        if name == "content_block_start":
            block = data["content_block"]
            trace.append(("start", data["index"], block["type"], block.get("name")))
        elif name == "content_block_delta":
            delta = dict(data["delta"])
            kind = delta.pop("type")
            (text,) = delta.values()
            _add(trace, ("delta", data["index"], kind), text)
        elif name == "content_block_stop":
            trace.append(("stop", data["index"]))
        elif name == "message_delta":
            trace.append(("end", data["delta"]["stop_reason"], data["usage"]["output_tokens"]))
    return trace


def _comparable(message: Message) -> dict[str, Any]:
    """A message without what differs from request to request: its id and its tool
    uses' ids (random), and how its input tokens split by what the prefix cache held."""
    out = message.model_dump(
        exclude={"id": True, "usage": {"input_tokens", "cache_read_input_tokens"}}
    )
    for block in out["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id")
    return out


def anthropic_message(base_url: str, body: dict[str, Any]) -> tuple[dict[str, Any], Trace, Drafts]:
    """A Messages request sent whole, then streamed: the message (the stream must add
    up to the same), the stream's trace, and what the two drafted."""
    before = drafts(base_url)
    r = post(base_url, "/v1/messages", body)
    assert r.status_code == 200, r.text
    whole = _comparable(check_message(r.json()))
    events = read_events(base_url, body)
    assert _comparable(check_stream(events)) == whole
    return whole, message_trace(events.items), drafts(base_url) - before
