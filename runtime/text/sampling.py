"""Token sampling on device: logit transforms as pure functions plus a per-request Sampler.

Nothing here reads an array back to the host (no ``.item()``, no ``tolist()``), so the decode
loop can queue step N+1 with ``mx.async_eval`` before it reads token N. All transforms take
``(1, V)`` float32 logits and return arrays of the same shape, masking with ``-inf``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from runtime.types import ReasoningBudget, SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SampleResult:
    """One sampled step, still on device.

    ``logprob`` and ``top_logprobs`` are under the model's raw distribution (log-softmax of the
    unmodified logits), as OpenAI reports them. All fields are lazy: evaluate only what the
    request needs. Greedy with just ``token`` evaluated costs one argmax; ``logprob`` adds a
    log-sum-exp over the vocabulary (about 1.5 ms for 150k entries on CPU).
    """

    token: mx.array  # (1,) int32
    logprob: mx.array  # (1,) float32
    top_ids: mx.array | None = None  # (1, k) int32, best first
    top_logprobs: mx.array | None = None  # (1, k) float32


# ---------------------------------------------------------------------------------------------
# Pure transforms


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def apply_logit_bias(logits: mx.array, bias: mx.array) -> mx.array:
    """``bias`` is a dense (V,) vector (zeros where no bias was asked for)."""
    return logits + bias


def apply_repetition_penalty(logits: mx.array, seen: mx.array, penalty: float) -> mx.array:
    """HF semantics: for every token seen (once, however often), positive logits are divided by
    the penalty and negative ones multiplied by it."""
    penalized = mx.where(logits > 0, logits / penalty, logits * penalty)
    return mx.where(seen, penalized, logits)


def apply_presence_frequency(
    logits: mx.array, counts: mx.array, presence: float, frequency: float
) -> mx.array:
    """OpenAI semantics: ``logit -= presence * (count > 0) + frequency * count``."""
    return logits - (presence * (counts > 0).astype(mx.float32) + frequency * counts)


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """Keep exactly the k largest logits (ties broken by index order of argpartition)."""
    vocab = logits.shape[-1]
    if k <= 0 or k >= vocab:
        return logits
    keep_ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    mask = mx.put_along_axis(
        mx.zeros(logits.shape, dtype=mx.bool_), keep_ids, mx.array(True), axis=-1
    )
    return mx.where(mask, logits, _NEG_INF)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Nucleus: keep the smallest set of most likely tokens whose mass reaches ``p``; the most
    likely token always survives because the mass before it is 0."""
    if p >= 1.0:
        return logits
    order = mx.argsort(-logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < p
    mask = mx.put_along_axis(mx.zeros(logits.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(mask, logits, _NEG_INF)


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """Drop tokens whose probability is below ``min_p`` times the top probability. In log space
    that is ``logit - max_logit < log(min_p)``, so no softmax is needed."""
    if min_p <= 0.0:
        return logits
    threshold = mx.max(logits, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logits >= threshold, logits, _NEG_INF)


def top_logprobs(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k best (ids, logprobs), sorted best first; shapes (1, k)."""
    vocab = logprobs.shape[-1]
    if k <= 0:
        return mx.zeros((1, 0), dtype=mx.int32), mx.zeros((1, 0), dtype=mx.float32)
    if k >= vocab:
        ids = mx.argsort(-logprobs, axis=-1)
    else:
        ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        order = mx.argsort(-mx.take_along_axis(logprobs, ids, axis=-1), axis=-1)
        ids = mx.take_along_axis(ids, order, axis=-1)
    return ids.astype(mx.int32), mx.take_along_axis(logprobs, ids, axis=-1)


# ---------------------------------------------------------------------------------------------
# Per-request sampler


def _check_params(params: SamplingParams, vocab_size: int) -> None:
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if params.repetition_penalty <= 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.top_logprobs < 0:
        raise ValueError(f"top_logprobs must be >= 0, got {params.top_logprobs}")


def _dense_bias(bias: Mapping[int, float], vocab_size: int) -> mx.array | None:
    if not bias:
        return None
    dense = np.zeros((vocab_size,), dtype=np.float32)
    for token_id, value in bias.items():
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary")
        dense[token_id] = value
    return mx.array(dense)


def _prompt_mask(prompt_tokens: Sequence[int], vocab_size: int) -> mx.array:
    ids = np.asarray(prompt_tokens, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError("prompt token id outside the vocabulary")
    mask = np.zeros((vocab_size,), dtype=np.bool_)
    mask[ids] = True
    return mx.array(mask)


class Sampler:
    """Samples one request's tokens; keeps its penalty counts and RNG key on device."""

    def __init__(
        self, params: SamplingParams, vocab_size: int, prompt_tokens: Sequence[int]
    ) -> None:
        _check_params(params, vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self._bias = _dense_bias(params.logit_bias, vocab_size)
        # top_k == 1 is greedy at any temperature; argmax keeps it exact under ties.
        self._greedy = params.greedy or params.top_k == 1
        self._penalized = params.penalized
        self._seen_prompt: mx.array | None = None
        self._counts: mx.array | None = None
        if self._penalized:
            self._counts = mx.zeros((vocab_size,), dtype=mx.float32)
            if params.repetition_penalty != 1.0:
                self._seen_prompt = _prompt_mask(prompt_tokens, vocab_size)
        # A private key chain: reproducible with a seed, and never the process-global RNG.
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._key = mx.random.key(seed % (1 << 64))
        self._budget = params.reasoning_budget
        if self._budget is not None:
            # on device, so the pipelined decode never waits for a token to be read
            self._inside = mx.array(self._budget.inside)
            self._spent = mx.array(0, dtype=mx.int32)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or keeps state (no bias, penalty,
        reasoning budget or logprobs): its token is the argmax of the raw logits, so
        several positions can be read at once (a speculative step's verify rows)."""
        return (
            self._greedy
            and self._bias is None
            and self._counts is None
            and self._budget is None
            and not self.params.logprobs
        )

    def sample(self, logits: mx.array, mask: mx.array | None = None) -> SampleResult:
        """`mask`: the tokens a grammar allows next, a (V,) boolean vector (the rest are
        never drawn; logprobs stay those of the unmasked distribution)."""
        raw = logits.reshape(1, -1).astype(mx.float32)
        adjusted = self._adjust(raw)
        if mask is not None:
            adjusted = mx.where(mask, adjusted, _NEG_INF)
        if self._greedy:
            token = mx.argmax(adjusted, axis=-1).astype(mx.int32)
        else:
            token = self._draw(adjusted)
        if self._budget is not None:
            token = self._spend(token, self._budget)
        self._record(token)
        logprobs = log_softmax(raw)
        chosen = mx.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
        if not self.params.logprobs:
            return SampleResult(token=token, logprob=chosen)
        top_ids, top_lps = top_logprobs(logprobs, self.params.top_logprobs)
        return SampleResult(token=token, logprob=chosen, top_ids=top_ids, top_logprobs=top_lps)

    def _adjust(self, logits: mx.array) -> mx.array:
        """Bias first, then penalties; the hot greedy path skips all of it."""
        if self._bias is not None:
            logits = apply_logit_bias(logits, self._bias)
        if self._counts is None:
            return logits
        p = self.params
        if self._seen_prompt is not None:
            seen = mx.logical_or(self._seen_prompt, self._counts > 0)
            logits = apply_repetition_penalty(logits, seen, p.repetition_penalty)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            logits = apply_presence_frequency(
                logits, self._counts, p.presence_penalty, p.frequency_penalty
            )
        return logits

    def _draw(self, logits: mx.array) -> mx.array:
        p = self.params
        logits = logits / p.temperature
        keys = mx.random.split(self._key)
        self._key = keys[0]
        if 0 < p.top_k < self.vocab_size:
            # Same result as apply_top_k on the full row, but top_p's sort then runs over k
            # candidates instead of the whole vocabulary (a full sort costs ~10 ms on CPU).
            candidates = mx.argpartition(-logits, kth=p.top_k - 1, axis=-1)[:, : p.top_k]
            sub = mx.take_along_axis(logits, candidates, axis=-1)
            sub = apply_min_p(apply_top_p(sub, p.top_p), p.min_p)
            pick = mx.random.categorical(sub, axis=-1, key=keys[1])
            return mx.take_along_axis(candidates, pick[:, None], axis=-1)[:, 0].astype(mx.int32)
        logits = apply_min_p(apply_top_p(logits, p.top_p), p.min_p)
        return mx.random.categorical(logits, axis=-1, key=keys[1]).astype(mx.int32)

    def _spend(self, token: mx.array, budget: ReasoningBudget) -> mx.array:
        """Count reasoning tokens; once the budget is spent, the block's close comes next."""
        spent = mx.logical_and(self._inside, self._spent >= budget.tokens)
        token = mx.where(spent, mx.array(budget.close_id, dtype=mx.int32), token)
        self._spent = self._spent + self._inside.astype(mx.int32)
        inside = mx.logical_and(self._inside, token[0] != budget.close_id)
        if budget.open_id is not None:
            inside = mx.logical_or(inside, token[0] == budget.open_id)
        self._inside = inside
        return token

    def _record(self, token: mx.array) -> None:
        # Lazy scatter: evaluated along with the next step's logits, so no sync here.
        if self._counts is not None:
            self._counts = self._counts.at[token].add(1.0)
