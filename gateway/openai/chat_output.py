"""Parser events -> OpenAI chat deltas, and the final message of a non-streamed reply.

Reasoning goes out as both `reasoning` and `reasoning_content` (clients read one or
the other). A tool call's first delta carries index, id, type and name; later deltas
append argument fragments. With parallel_tool_calls false only the first call is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    ended: bool = False


@dataclass
class ChatOutput:
    parallel: bool = True
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    reasoning_tokens: int = 0

    def _keep(self, index: int) -> bool:
        return self.parallel or index == min(self.calls, default=index)

    def deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        """Record events; return the deltas to stream for them (in order)."""
        out: list[dict[str, Any]] = []
        for ev in events:
            delta = self._one(ev)
            if delta is not None:
                out.append(delta)
        return out

    def _one(self, ev: Event) -> dict[str, Any] | None:
        if isinstance(ev, Content):
            if not ev.text:
                return None
            self.content.append(ev.text)
            return {"content": ev.text}
        if isinstance(ev, Reasoning):
            if not ev.text:
                return None
            self.reasoning.append(ev.text)
            return {"reasoning": ev.text, "reasoning_content": ev.text}
        if isinstance(ev, ToolCallStart):
            if not self.parallel and self.calls:
                return None
            self.calls[ev.index] = _Call(ev.id, ev.name)
            head = {"index": self._wire_index(ev.index), "id": ev.id, "type": "function"}
            return {"tool_calls": [{**head, "function": {"name": ev.name, "arguments": ""}}]}
        if isinstance(ev, ToolCallArgs):
            call = self.calls.get(ev.index)
            if call is None or not ev.fragment:
                return None
            call.arguments.append(ev.fragment)
            frag = {"index": self._wire_index(ev.index), "function": {"arguments": ev.fragment}}
            return {"tool_calls": [frag]}
        if isinstance(ev, ToolCallEnd) and ev.index in self.calls:
            self.calls[ev.index].ended = True
        return None

    def _wire_index(self, index: int) -> int:
        return sorted(self.calls).index(index)

    def count_tokens(self, events: list[Event], n_tokens: int) -> None:
        """Tokens whose text went only to reasoning count as reasoning tokens."""
        if events and all(isinstance(e, Reasoning) for e in events):
            self.reasoning_tokens += n_tokens

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def message(self) -> dict[str, Any]:
        text = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": text or (None if self.calls else "")}
        if self.reasoning:
            joined = "".join(self.reasoning)
            msg["reasoning"] = msg["reasoning_content"] = joined
        if self.calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": "".join(call.arguments) or "{}"},
                }
                for _, call in sorted(self.calls.items())
            ]
        return msg
