"""One sequence's host side: sampled tokens in, text deltas out, and when it is done.

Detokenizing, stop strings, end-of-sequence ids, logprobs and cancellation for one
request; the scheduler feeds it every token it reads back for that sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.batch.generate import SampledToken
from runtime.text.detokenizer import DetokenizerTable, StreamingDetokenizer
from runtime.text.stops import StopMatcher
from runtime.types import FinishReason, TextDelta, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from runtime.engine.engine import RequestHandle


@dataclass
class Progress:
    """What one request has done so far, for the finish event and the trie."""

    prompt: tuple[int, ...]
    reused: int = 0
    generated: list[int] = field(default_factory=list)
    first_at: float | None = None
    reason: FinishReason = FinishReason.LENGTH
    stop_string: str | None = None  # the stop string that ended it, if one did


class SequenceOutput:
    """Turns one request's sampled tokens into its text deltas (see the module docstring)."""

    def __init__(
        self,
        handle: RequestHandle,
        table: DetokenizerTable,
        eos_ids: frozenset[int],
        max_tokens: int,
    ) -> None:
        req = handle.request
        self.handle = handle
        self.progress = Progress(req.prompt_tokens)
        self.max_tokens = max_tokens
        self._table = table
        self._detok = StreamingDetokenizer(table)
        self._stops = StopMatcher(req.stop_strings)
        self._eos = eos_ids | frozenset(req.stop_token_ids)
        self._logprobs = req.sampling.logprobs

    def _token_logprobs(self, sampled: SampledToken) -> tuple[TokenLogprob, ...]:
        if not self._logprobs:
            return ()
        text: Callable[[int], str] = self._table.token_text
        top = tuple(TopLogprob(i, text(i), lp) for i, lp in sampled.top)
        logprob = sampled.logprob if sampled.logprob is not None else 0.0
        return (TokenLogprob(sampled.token_id, text(sampled.token_id), logprob, top),)

    def accept(self, sampled: SampledToken) -> bool:
        """Stream one token; True when the sequence is finished (its reason is set)."""
        p = self.progress
        if p.first_at is None:
            p.first_at = time.perf_counter()
        p.generated.append(sampled.token_id)
        logprobs = self._token_logprobs(sampled)
        emit = self.handle._emit
        if sampled.token_id in self._eos:
            text, _ = self._drain()
            emit(TextDelta(text, (sampled.token_id,), logprobs))
            p.reason = FinishReason.STOP
            p.stop_string = self._stops.matched  # held-back text may have ended in one
            return True
        text, hit = self._stops.feed(self._detok.add(sampled.token_id))
        emit(TextDelta(text, (sampled.token_id,), logprobs))
        if hit:
            p.reason = FinishReason.STOP
            p.stop_string = self._stops.matched
            return True
        if self.handle.cancelled:
            p.reason = FinishReason.CANCELLED
            return True
        if len(p.generated) >= self.max_tokens:
            self._end_at_length()
            return True
        return False

    def _end_at_length(self) -> None:
        tail, hit = self._drain()
        if tail:
            self.handle._emit(TextDelta(tail))
        if hit or self._stops.stopped:
            self.progress.reason = FinishReason.STOP
            self.progress.stop_string = self._stops.matched

    def _drain(self) -> tuple[str, bool]:
        """Release held-back text at the end, still honouring stop strings."""
        text, hit = self._stops.feed(self._detok.flush())
        return (text, True) if hit else (text + self._stops.flush(), False)
