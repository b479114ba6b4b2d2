"""One generation read through its parser: the events every dialect's emitter maps to
its own wire shape, and what they add up to (content, reasoning, tool calls, usage)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import parsers
from gateway.core.generation import Generations, failure
from parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallStart
from runtime.types import Finished, FinishReason, GenerationStats, TextDelta


@dataclass
class Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    ended: bool = False

    @property
    def json(self) -> str:
        return "".join(self.arguments) or "{}"


@dataclass
class Reply:
    """What a reply added up to. With `parallel` False only the first tool call is kept."""

    parallel: bool = True
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, Call] = field(default_factory=dict)
    reasoning_tokens: int = 0
    done: Finished | None = None

    def record(self, events: list[Event]) -> list[Event]:
        """Record events; return the ones to emit (empty text and dropped calls removed)."""
        return [ev for ev in events if self._one(ev)]

    def _one(self, ev: Event) -> bool:
        if isinstance(ev, Content):
            if ev.text:
                self.content.append(ev.text)
            return bool(ev.text)
        if isinstance(ev, Reasoning):
            if ev.text:
                self.reasoning.append(ev.text)
            return bool(ev.text)
        if isinstance(ev, ToolCallStart):
            if not self.parallel and self.calls:
                return False
            self.calls[ev.index] = Call(ev.id, ev.name)
            return True
        if isinstance(ev, ToolCallArgs):
            call = self.calls.get(ev.index)
            if call is None or not ev.fragment:
                return False
            call.arguments.append(ev.fragment)
            return True
        if ev.index in self.calls:
            self.calls[ev.index].ended = True
            return True
        return False

    def count_tokens(self, events: list[Event], n_tokens: int) -> None:
        """Tokens whose text went only to reasoning count as reasoning tokens."""
        if events and all(isinstance(e, Reasoning) for e in events):
            self.reasoning_tokens += n_tokens

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    def ordered_calls(self) -> list[Call]:
        return [call for _, call in sorted(self.calls.items())]

    @property
    def stats(self) -> GenerationStats:
        assert self.done is not None
        return self.done.stats

    @property
    def cancelled(self) -> bool:
        return self.done is None or self.done.reason is FinishReason.CANCELLED


async def parsed(
    gens: Generations, index: int, parser: parsers.Parser, reply: Reply
) -> AsyncIterator[list[Event]]:
    """Choice `index`'s parser events, one list per engine delta (and one for the
    parser's finish); `reply` records them and ends with `done` set. A failed
    generation raises its APIError after the parser's last events."""
    async for item in gens.events(index):
        if isinstance(item, TextDelta):
            events = parser.feed(item.text)
            reply.count_tokens(events, len(item.token_ids))
            kept = reply.record(events)
            if kept:
                yield kept
            continue
        reply.done = item
        kept = reply.record(parser.finish(truncated=item.reason is FinishReason.LENGTH))
        if kept:
            yield kept
        error = failure(item)
        if error is not None:
            raise error
