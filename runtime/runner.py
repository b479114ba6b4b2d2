"""Runs one request on the loaded model: prefix reuse, sampling, detokenizing, stops.

Called only from the engine's worker thread, the one thread that owns MLX.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from runtime.constraints import GrammarVocabulary, TokenMatcher
from runtime.detokenizer import DetokenizerTable, StreamingDetokenizer
from runtime.generate import DEFAULT_PREFILL_CHUNK, Cancelled, SampledToken, generate_tokens
from runtime.prefix_cache import PrefixCache
from runtime.prefix_report import CacheReport
from runtime.sampling import Sampler
from runtime.stops import StopMatcher
from runtime.types import (
    Constraint,
    Finished,
    FinishReason,
    GenerationStats,
    TextDelta,
    TokenLogprob,
    TopLogprob,
)

if TYPE_CHECKING:
    from runtime.engine import RequestHandle
    from runtime.loader import LoadedModel

log = logging.getLogger(__name__)


def default_prefix_cache_bytes() -> int:
    """A fifth of physical memory: room for many paged-out conversations, and the
    model and live caches keep the rest."""
    try:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 1024**3
    return int(total // 5)


@dataclass(frozen=True)
class RunnerSettings:
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    prefix_cache_bytes: int = field(default_factory=default_prefix_cache_bytes)
    snapshot_interval: int = 1024


@dataclass
class _Progress:
    """What one request has done so far, for the finish event and the trie."""

    prompt: tuple[int, ...]
    reused: int
    generated: list[int] = field(default_factory=list)
    first_at: float | None = None
    reason: FinishReason = FinishReason.LENGTH
    stop_string: str | None = None  # the stop string that ended it, if one did


@dataclass(frozen=True)
class _CacheView:
    at: float  # wall clock when it was taken
    stats: dict[str, int]
    pins: list[dict[str, object]]
    recent: list[CacheReport]
    trie: list[str]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, settings: RunnerSettings | None = None) -> None:
        self.loaded = loaded
        self.settings = settings or RunnerSettings()
        tok = loaded.tokenizer
        self._detok_table = DetokenizerTable.build(tok.hf, tok.special_ids)
        self.prefix: PrefixCache[Any] = PrefixCache(
            loaded.model.make_caches,
            budget_bytes=self.settings.prefix_cache_bytes,
            snapshot_interval=self.settings.snapshot_interval,
        )
        # held while a request runs, so a dump from another thread sees a settled trie
        self.lock = threading.Lock()
        self._stream: Any = None
        self._settled = self._settle()  # the view a busy engine answers with
        self._grammar_vocab: GrammarVocabulary | None = None  # built on first use

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """The model's vocabulary in the grammar engine, imported once (about 1.5 s for
        150k tokens) by the first constrained request."""
        if self._grammar_vocab is None:
            loaded = self.loaded
            self._grammar_vocab = GrammarVocabulary(
                loaded.tokenizer.hf.to_str(), loaded.model.args.vocab_size, loaded.eos_token_ids
            )
        return self._grammar_vocab

    def _matcher(self, constraint: Constraint | None) -> TokenMatcher | None:
        return None if constraint is None else self.grammar_vocabulary().matcher(constraint)

    def _token_text(self, token_id: int) -> str:
        return self._detok_table.token_text(token_id)

    def _logprobs(self, sampled: SampledToken) -> tuple[TokenLogprob, ...]:
        top = tuple(TopLogprob(i, self._token_text(i), lp) for i, lp in sampled.top)
        text = self._token_text(sampled.token_id)
        logprob = sampled.logprob if sampled.logprob is not None else 0.0
        return (TokenLogprob(sampled.token_id, text, logprob, top),)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.loaded.tokenizer.decode(ids, skip_special_tokens=False)

    def _settle(self) -> _CacheView:
        """Copy what the prefix-cache view shows; the caller holds the lock."""
        p = self.prefix
        return _CacheView(time.time(), p.stats(), p.pins(), p.recent(), p.dump().splitlines())

    def prefix_cache_view(self, wait_s: float = 0.25) -> dict[str, Any]:
        """The trie, its counters, the live pins and the last requests' cache reports
        (oldest first, token ids decoded). While a request runs (after `wait_s`), the
        view taken when the previous request finished, marked `busy`."""
        busy = not self.lock.acquire(timeout=wait_s)
        if busy:
            view = self._settled
        else:
            try:
                view = self._settle()
            finally:
                self.lock.release()
        return {
            "busy": busy,
            "as_of": view.at,
            "stats": view.stats,
            "pins": view.pins,
            "recent": [r.describe(self._decode) for r in view.recent],
            "trie": view.trie,
        }

    def run(self, handle: RequestHandle) -> Finished:
        if self._stream is None:
            self._stream = mx.new_stream(mx.default_device())
        with self.lock, mx.stream(self._stream):
            try:
                return self._run(handle)
            finally:
                self._settled = self._settle()

    def _run(self, handle: RequestHandle) -> Finished:
        req = handle.request
        prompt = req.prompt_tokens
        room = self.loaded.context_length - len(prompt)
        if room <= 0:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room in the "
                f"{self.loaded.context_length}-token context"
            )
        mx.reset_peak_memory()
        start = time.perf_counter()
        matcher = self._matcher(req.constraint)  # a grammar that cannot compile fails here
        lease = self.prefix.begin(prompt, pin=req.pin, boundaries=req.boundaries)
        if lease.report is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("request %d: %s", lease.serial, lease.report.log_line(self._decode))
        progress = _Progress(prompt, lease.reused)
        tokens = generate_tokens(
            self.loaded.model,
            lease.caches,
            prompt[lease.reused :],
            Sampler(req.sampling, self.loaded.model.args.vocab_size, prompt),
            max_tokens=min(req.max_tokens, room),
            prefill_chunk=req.prefill_chunk or self.settings.prefill_chunk,
            cancelled=lambda: handle.cancelled,
            offset=lease.reused,
            pauses=lease.snapshot_points,
            on_pause=lambda at: self.prefix.snapshot_at(lease, at),
            constraint=matcher,
        )
        try:
            self._stream_tokens(handle, tokens, progress)
        except Cancelled:
            progress.reason = FinishReason.CANCELLED
        except BaseException:
            tokens.close()
            self.prefix.discard(lease)  # the caches may hold half a step: never reuse them
            raise
        tokens.close()
        held = lease.caches[0].offset if lease.caches else 0
        self.prefix.end(lease, (prompt + tuple(progress.generated))[:held])
        return self._finish(progress, start)

    def _stream_tokens(
        self, handle: RequestHandle, tokens: Any, progress: _Progress
    ) -> None:
        req = handle.request
        detok = StreamingDetokenizer(self._detok_table)
        stops = StopMatcher(req.stop_strings)
        eos = self.loaded.eos_token_ids | frozenset(req.stop_token_ids)
        for sampled in tokens:
            if progress.first_at is None:
                progress.first_at = time.perf_counter()
            progress.generated.append(sampled.token_id)
            logprobs = self._logprobs(sampled) if req.sampling.logprobs else ()
            if sampled.token_id in eos:
                progress.reason = FinishReason.STOP
                handle._emit(TextDelta(_drain(detok, stops)[0], (sampled.token_id,), logprobs))
                progress.stop_string = stops.matched  # held-back text may have ended in one
                return
            text, hit = stops.feed(detok.add(sampled.token_id))
            handle._emit(TextDelta(text, (sampled.token_id,), logprobs))
            if hit:
                progress.reason = FinishReason.STOP
                progress.stop_string = stops.matched
                return
            if handle.cancelled:
                progress.reason = FinishReason.CANCELLED
                return
        tail, hit = _drain(detok, stops)
        if tail:
            handle._emit(TextDelta(tail))
        if hit or stops.stopped:
            progress.reason = FinishReason.STOP
            progress.stop_string = stops.matched

    def _finish(self, progress: _Progress, start: float) -> Finished:
        end = time.perf_counter()
        first = progress.first_at if progress.first_at is not None else end
        stats = GenerationStats(
            prompt_tokens=len(progress.prompt),
            completion_tokens=len(progress.generated),
            cached_tokens=progress.reused,
            prefill_seconds=first - start,
            decode_seconds=end - first,
            peak_memory_bytes=int(mx.get_peak_memory()),
        )
        log.debug(
            "request %s: prompt=%d reused=%d computed=%d completion=%d "
            "prefill=%.1f tok/s decode=%.1f tok/s",
            progress.reason.value, stats.prompt_tokens, progress.reused,
            stats.prompt_tokens - progress.reused, stats.completion_tokens,
            stats.prefill_tps, stats.decode_tps,
        )
        return Finished(progress.reason, stats, stop_string=progress.stop_string)


def _drain(detok: StreamingDetokenizer, stops: StopMatcher) -> tuple[str, bool]:
    """Release held-back text at the end, still honouring stop strings."""
    text, hit = stops.feed(detok.flush())
    return (text, True) if hit else (text + stops.flush(), False)
