"""The generation loop: chunked prefill, then decode pipelined with mx.async_eval.

Decode queues step N+1 on the device before reading token N on the host, so the
host-side work (detokenizing, stop strings, streaming) overlaps the next forward.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from runtime.cache import reserve_prompt
from runtime.text import Sampler, SampleResult

DEFAULT_PREFILL_CHUNK = 2048


class Cancelled(Exception):
    """Raised inside the loop when the request's cancel flag is seen."""


class CausalLM(Protocol):
    def forward(self, tokens: mx.array, caches: list[Any]) -> mx.array: ...
    def logits(self, hidden: mx.array) -> mx.array: ...


class TokenConstraint(Protocol):
    """A grammar's state (runtime.text.constraints.TokenMatcher): the mask of the tokens it
    allows next, and the sampled token fed back."""

    def mask(self) -> mx.array: ...
    def advance(self, token: int) -> None: ...


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # None unless the request asked for logprobs
    top: tuple[tuple[int, float], ...]


def _cache_arrays(caches: Sequence[Any]) -> list[mx.array]:
    out: list[mx.array] = []
    for cache in caches:
        out.extend(cache.state)
    return out


def prefill(
    model: CausalLM,
    caches: list[Any],
    tokens: Sequence[int],
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
    cancelled: Callable[[], bool] = lambda: False,
    offset: int = 0,
    pauses: Sequence[int] = (),
    on_pause: Callable[[int], None] = lambda _: None,
) -> list[int]:
    """Run all but the last of `tokens` through the model in chunks.

    `tokens` continue a sequence whose first `offset` tokens the caches already hold.
    Chunks end at each absolute offset in `pauses`, where `on_pause(offset)` runs (the
    prefix cache snapshots there). Returns the tokens still to be fed (at least one),
    whose logits start decoding. Each chunk is evaluated and the allocator cache
    cleared, so peak memory stays bounded by one chunk's activations.
    """
    if not tokens:
        raise ValueError("cannot generate from an empty prompt")
    rest = list(tokens)
    chunk = max(1, chunk)
    reserve_prompt(caches, offset + len(rest))
    marks = sorted(p for p in pauses if offset < p)
    while True:
        if marks and marks[0] == offset:
            on_pause(marks.pop(0))
        if len(rest) <= 1:
            return rest
        if cancelled():
            raise Cancelled
        n = min(chunk, len(rest) - 1)
        if marks:
            n = min(n, marks[0] - offset)
        model.forward(mx.array(rest[:n], dtype=mx.int32)[None], caches)
        mx.eval(_cache_arrays(caches))
        mx.clear_cache()
        rest = rest[n:]
        offset += n


def sample_arrays(result: SampleResult) -> list[mx.array]:
    """The arrays of a sample to evaluate before reading it back (`read_sampled`)."""
    # the chosen token's logprob costs a log-sum-exp over the vocabulary: only
    # evaluate it (and the top ids) when the request asked for logprobs
    if result.top_ids is None or result.top_logprobs is None:
        return [result.token]
    return [result.token, result.logprob, result.top_ids, result.top_logprobs]


def read_sampled(result: SampleResult) -> SampledToken:
    """A sample read back to the host (waits for the device)."""
    token = int(result.token.item())  # type: ignore[arg-type]
    if result.top_ids is None or result.top_logprobs is None:
        return SampledToken(token, None, ())
    ids: list[int] = result.top_ids.reshape(-1).tolist()  # type: ignore[assignment]
    lps: list[float] = result.top_logprobs.reshape(-1).tolist()  # type: ignore[assignment]
    top = tuple((int(i), float(lp)) for i, lp in zip(ids, lps, strict=True))
    return SampledToken(token, float(result.logprob.item()), top)  # type: ignore[arg-type]


def _logits(model: CausalLM, caches: list[Any], inputs: mx.array) -> mx.array:
    return model.logits(model.forward(inputs, caches)[:, -1, :])


def _next(model: CausalLM, caches: list[Any], inputs: mx.array, sampler: Sampler) -> SampleResult:
    return sampler.sample(_logits(model, caches, inputs))


def generate_tokens(
    model: CausalLM,
    caches: list[Any],
    prompt: Sequence[int],
    sampler: Sampler,
    *,
    max_tokens: int,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    cancelled: Callable[[], bool] = lambda: False,
    offset: int = 0,
    pauses: Sequence[int] = (),
    on_pause: Callable[[int], None] = lambda _: None,
    constraint: TokenConstraint | None = None,
) -> Generator[SampledToken, None, None]:
    """Yield up to max_tokens sampled tokens; the consumer stops early by closing.

    `prompt` is what the caches do not hold yet (they hold `offset` tokens); `pauses`
    and `on_pause` are passed to `prefill`; every token keeps to `constraint`, if given.
    Runs on the caller's default stream.
    """
    if max_tokens <= 0:
        return
    rest = prefill(
        model,
        caches,
        prompt,
        chunk=prefill_chunk,
        cancelled=cancelled,
        offset=offset,
        pauses=pauses,
        on_pause=on_pause,
    )
    if cancelled():
        raise Cancelled
    if constraint is not None:
        yield from _constrained(model, caches, rest, sampler, constraint, max_tokens, cancelled)
        return
    current = _next(model, caches, mx.array(rest, dtype=mx.int32)[None], sampler)
    mx.async_eval(sample_arrays(current))
    for produced in range(1, max_tokens + 1):
        pending = None
        if produced < max_tokens:
            # queue the next step before reading this one: the device works
            # while the host detokenizes and streams
            pending = _next(model, caches, current.token.reshape(1, 1), sampler)
            mx.async_eval(sample_arrays(pending))
        yield read_sampled(current)
        if pending is None:
            return
        if cancelled():
            raise Cancelled
        current = pending
        if produced % 256 == 0:
            mx.clear_cache()


def _constrained(
    model: CausalLM,
    caches: list[Any],
    rest: list[int],
    sampler: Sampler,
    constraint: TokenConstraint,
    max_tokens: int,
    cancelled: Callable[[], bool],
) -> Generator[SampledToken, None, None]:
    """The decode loop under a grammar. Step k+1's mask needs token k on the host, so
    only the forward is queued ahead: the device computes step k+1's logits while the
    host reads token k, streams it and advances the grammar; then k+1 is sampled under
    its mask and step k+2's forward queued behind it."""
    logits = _logits(model, caches, mx.array(rest, dtype=mx.int32)[None])
    mx.async_eval(logits)
    current = sampler.sample(logits, constraint.mask())
    mx.async_eval(sample_arrays(current))
    for produced in range(1, max_tokens + 1):
        pending = None
        if produced < max_tokens:
            pending = _logits(model, caches, current.token.reshape(1, 1))
            mx.async_eval(pending)
        sampled = read_sampled(current)
        constraint.advance(sampled.token_id)
        yield sampled
        if pending is None:
            return
        if cancelled():
            raise Cancelled
        current = sampler.sample(pending, constraint.mask())
        mx.async_eval(sample_arrays(current))
        if produced % 256 == 0:
            mx.clear_cache()
