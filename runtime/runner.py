"""Runs one request on the loaded model: sampling, detokenizing, stops, stats.

Called only from the engine's worker thread, the one thread that owns MLX.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from runtime.detokenizer import DetokenizerTable, StreamingDetokenizer
from runtime.generate import DEFAULT_PREFILL_CHUNK, Cancelled, SampledToken, generate_tokens
from runtime.sampling import Sampler
from runtime.stops import StopMatcher
from runtime.types import (
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


class ModelRunner:
    def __init__(self, loaded: LoadedModel, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk
        tok = loaded.tokenizer
        self._detok_table = DetokenizerTable.build(tok.hf, tok.special_ids)
        self._stream: Any = None

    def _token_text(self, token_id: int) -> str:
        return self._detok_table.token_text(token_id)

    def _logprobs(self, sampled: SampledToken) -> tuple[TokenLogprob, ...]:
        top = tuple(TopLogprob(i, self._token_text(i), lp) for i, lp in sampled.top)
        text = self._token_text(sampled.token_id)
        logprob = sampled.logprob if sampled.logprob is not None else 0.0
        return (TokenLogprob(sampled.token_id, text, logprob, top),)

    def run(self, handle: RequestHandle) -> Finished:
        if self._stream is None:
            self._stream = mx.new_stream(mx.default_device())
        req = handle.request
        prompt = req.prompt_tokens
        limit = self.loaded.context_length - len(prompt)
        if limit <= 0:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room in the "
                f"{self.loaded.context_length}-token context"
            )
        max_tokens = min(req.max_tokens, limit)
        sampler = Sampler(req.sampling, self.loaded.model.args.vocab_size, prompt)
        detok = StreamingDetokenizer(self._detok_table)
        stops = StopMatcher(req.stop_strings)
        eos = self.loaded.eos_token_ids | frozenset(req.stop_token_ids)
        want_logprobs = req.sampling.logprobs

        mx.reset_peak_memory()
        start = time.perf_counter()
        first_at: float | None = None
        produced = 0
        reason = FinishReason.LENGTH
        tokens = generate_tokens(
            self.loaded.model,
            self.loaded.model.make_caches(),
            prompt,
            sampler,
            max_tokens=max_tokens,
            prefill_chunk=req.prefill_chunk or self.prefill_chunk,
            cancelled=lambda: handle.cancelled,
            stream=self._stream,
        )
        try:
            for sampled in tokens:
                if first_at is None:
                    first_at = time.perf_counter()
                produced += 1
                logprobs = self._logprobs(sampled) if want_logprobs else ()
                if sampled.token_id in eos:
                    reason = FinishReason.STOP
                    handle._emit(TextDelta(_drain(detok, stops)[0], (sampled.token_id,), logprobs))
                    break
                text, hit = stops.feed(detok.add(sampled.token_id))
                handle._emit(TextDelta(text, (sampled.token_id,), logprobs))
                if hit:
                    reason = FinishReason.STOP
                    break
                if handle.cancelled:
                    reason = FinishReason.CANCELLED
                    break
            else:
                tail, hit = _drain(detok, stops)
                if tail:
                    handle._emit(TextDelta(tail))
                if hit:
                    reason = FinishReason.STOP
        except Cancelled:
            reason = FinishReason.CANCELLED
        finally:
            tokens.close()
        end = time.perf_counter()
        first = first_at if first_at is not None else end
        stats = GenerationStats(
            prompt_tokens=len(prompt),
            completion_tokens=produced,
            prefill_seconds=first - start,
            decode_seconds=end - first,
            peak_memory_bytes=int(mx.get_peak_memory()),
        )
        log.debug(
            "request done: %s prompt=%d completion=%d prefill=%.1f tok/s decode=%.1f tok/s",
            reason.value, stats.prompt_tokens, produced, stats.prefill_tps, stats.decode_tps,
        )
        return Finished(reason, stats)


def _drain(detok: StreamingDetokenizer, stops: StopMatcher) -> tuple[str, bool]:
    """Release held-back text at the end, still honouring stop strings."""
    text, hit = stops.feed(detok.flush())
    return (text, True) if hit else (text + stops.flush(), False)
