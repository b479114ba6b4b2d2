"""One sequence: its host side (sampled tokens in, text deltas out, and when it is done)
and the scheduler's record of it (`Seq`).

Detokenizing, stop strings, end-of-sequence ids, logprobs and cancellation for one
request; the scheduler feeds it every token it reads back for that sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from runtime.batch.drafts import DraftCounts, DraftLength, Lookup
from runtime.batch.generate import SampledToken, read_sampled
from runtime.text import DetokenizerTable, StopMatcher, StreamingDetokenizer
from runtime.types import (
    Finished,
    FinishReason,
    GenerationStats,
    TextDelta,
    TokenLogprob,
    TopLogprob,
)

if TYPE_CHECKING:
    from runtime.batch.handle import RequestHandle
    from runtime.batch.layered_prefill import LayeredChunk
    from runtime.batch.prompt_prefill import PromptPrefill
    from runtime.prefix import CacheReport
    from runtime.text import Sampler, SampleResult, TokenMatcher
    from runtime.vision.spans import PromptImages

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What one request has done so far, for the finish event and the trie."""

    prompt: tuple[int, ...]
    reused: int = 0
    generated: list[int] = field(default_factory=list)
    first_at: float | None = None
    reason: FinishReason = FinishReason.LENGTH
    stop_string: str | None = None  # the stop string that ended it, if one did
    cache: CacheReport | None = None  # what its prompt reused from the trie, and why not more


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
        emit = self.handle.emit
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
            self.handle.emit(TextDelta(tail))
        if hit or self._stops.stopped:
            self.progress.reason = FinishReason.STOP
            self.progress.stop_string = self._stops.matched

    def _drain(self) -> tuple[str, bool]:
        """Release held-back text at the end, still honouring stop strings."""
        text, hit = self._stops.feed(self._detok.flush())
        return (text, True) if hit else (text + self._stops.flush(), False)


@dataclass(eq=False)
class Seq:
    """One request as the scheduler holds it: queued for its prompt, then a row of the
    running batch (runtime/batch/scheduler.py)."""

    handle: RequestHandle
    out: SequenceOutput
    sampler: Sampler
    matcher: TokenMatcher | None
    start: float
    prefill: PromptPrefill | None = None
    caches: list[Any] | None = None  # its own caches, when the model's cannot batch
    input: mx.array | None = None  # (1,) the token the next step feeds
    unread: SampleResult | None = None  # sampled on the device, not yet read
    images: PromptImages | None = None  # its prompt's images (prefix-cache keys)
    layered: LayeredChunk | None = None  # its prompt's chunk on its way through the layers
    # speculative decoding (runtime/batch/speculative.py): what it has written, to draft
    # from; its draft length; what it drafted; and the tokens the next step feeds when
    # they are known on the host (the newest sampled token last)
    lookup: Lookup | None = None
    drafting: DraftLength = field(default_factory=DraftLength)
    drafts: DraftCounts = field(default_factory=DraftCounts)
    feed: list[int] = field(default_factory=list)

    @property
    def request(self) -> Any:
        return self.handle.request

    @property
    def shift(self) -> int:
        """Rotary position minus offset of its decode steps (multimodal RoPE)."""
        return 0 if self.images is None else self.images.shift

    def read(self) -> bool:
        """Read the last sampled token back and stream it; True when the sequence ended."""
        if self.unread is not None:
            sampled = read_sampled(self.unread)
            self.unread = None
            if self.take(sampled):
                return True
        if self.handle.cancelled:
            self.out.progress.reason = FinishReason.CANCELLED
            return True
        return False

    def take(self, sampled: SampledToken) -> bool:
        """A sampled token read back: the grammar advances, the token streams; True when
        the sequence ended."""
        if self.matcher is not None:
            self.matcher.advance(sampled.token_id)
        if self.lookup is not None:
            self.lookup.extend((sampled.token_id,))
        return self.out.accept(sampled)

    def finished(self, error: str | None = None) -> Finished:
        """Its Finished event, with the timings and token counts of its run."""
        p = self.out.progress
        end = time.perf_counter()
        first = p.first_at if p.first_at is not None else end
        # the prediction's tokens the output wrote where the prediction had them
        foreseen = self.lookup.foreseen if self.lookup is not None else 0
        stats = GenerationStats(
            prompt_tokens=len(p.prompt),
            completion_tokens=len(p.generated),
            cached_tokens=p.reused,
            prefill_seconds=first - self.start,
            decode_seconds=end - first,
            peak_memory_bytes=int(mx.get_peak_memory()),
            drafted_tokens=self.drafts.drafted,
            accepted_tokens=self.drafts.accepted,
            accepted_prediction_tokens=foreseen,
            rejected_prediction_tokens=len(self.request.prediction) - foreseen,
        )
        log.debug(
            "request %s: prompt=%d reused=%d computed=%d completion=%d "
            "prefill=%.1f tok/s decode=%.1f tok/s drafted=%d accepted=%d",
            p.reason.value, stats.prompt_tokens, p.reused, stats.prompt_tokens - p.reused,
            stats.completion_tokens, stats.prefill_tps, stats.decode_tps,
            stats.drafted_tokens, stats.accepted_tokens,
        )  # fmt: skip
        return Finished(p.reason, stats, error, stop_string=p.stop_string)
