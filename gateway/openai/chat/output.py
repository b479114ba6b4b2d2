"""Parser events -> OpenAI chat deltas, and the final message of a non-streamed reply.

Reasoning goes out as both `reasoning` and `reasoning_content` (clients read one or
the other). A tool call's first delta carries index, id, type and name; later deltas
append argument fragments. With parallel_tool_calls false only the first call is kept
(the neutral `Reply` decides what is kept; this maps it to the wire).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.core.reply import Reply
from parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallStart


@dataclass
class ChatOutput(Reply):
    def deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        """Record events; return the deltas to stream for them (in order)."""
        out: list[dict[str, Any]] = []
        for ev in self.record(events):
            delta = self._delta(ev)
            if delta is not None:
                out.append(delta)
        return out

    def _delta(self, ev: Event) -> dict[str, Any] | None:
        if isinstance(ev, Content):
            return {"content": ev.text}
        if isinstance(ev, Reasoning):
            return {"reasoning": ev.text, "reasoning_content": ev.text}
        if isinstance(ev, ToolCallStart):
            head = {"index": self._wire_index(ev.index), "id": ev.id, "type": "function"}
            return {"tool_calls": [{**head, "function": {"name": ev.name, "arguments": ""}}]}
        if isinstance(ev, ToolCallArgs):
            frag = {"index": self._wire_index(ev.index), "function": {"arguments": ev.fragment}}
            return {"tool_calls": [frag]}
        return None  # ToolCallEnd: nothing on the wire

    def _wire_index(self, index: int) -> int:
        return sorted(self.calls).index(index)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def message(self) -> dict[str, Any]:
        text = self.text
        msg: dict[str, Any] = {"role": "assistant", "content": text or (None if self.calls else "")}
        if self.reasoning:
            msg["reasoning"] = msg["reasoning_content"] = self.reasoning_text
        if self.calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.json},
                }
                for call in self.ordered_calls()
            ]
        return msg
