"""Speculative rejection sampling: checking tokens a draft model drew from its own
distribution, so that the output keeps the target model's distribution exactly.

A drafted token x drawn from the draft's q is accepted with probability min(1, p(x)/q(x)),
p the distribution the row's sampler draws from (temperature, top-k, top-p, min-p); at
the first rejection the row's token is drawn from the residual max(p - q, 0), normalized;
when every drafted token is accepted, the token after them is drawn from p. Each output
token is then distributed as p (Leviathan et al. 2023, Chen et al. 2023). The residual
never holds a rejected token (a rejection needs p(x) < q(x)), so the output token differs
from the drafted one exactly where the draft was rejected.

Only rows whose sampler keeps no state and changes nothing but the distribution draw this
way (`draws`): greedy rows, seeds (the output equals decoding without drafts, token for
token), penalties, logit_bias, reasoning budgets, grammars and logprobs get drafts that
are one token each (the draft model's argmax), checked by sampling and comparing
(runtime/batch/speculative.py), which keeps p just as exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from runtime.text import apply_min_p, apply_top_k, apply_top_p
from runtime.types import SamplingParams


def draws(params: SamplingParams) -> bool:
    """Whether a row sampling with `params` (and no grammar) checks drafts drawn from a
    distribution: it samples, and its sampler's draw is a function of the logits alone."""
    return (
        not params.greedy
        and params.top_k != 1
        and params.seed is None
        and not params.logit_bias
        and not params.penalized
        and params.reasoning_budget is None
        and not params.logprobs
    )


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """(n, V) float32 logits -> the distributions the sampler draws from, one a row
    (runtime/text/sampling.py's `Sampler._draw`: temperature, then top-k, top-p, min-p)."""
    x = logits.astype(mx.float32) / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        x = apply_top_k(x, params.top_k)
    x = apply_min_p(apply_top_p(x, params.top_p), params.min_p)
    return mx.softmax(x, axis=-1)


def judge(
    p: mx.array, q: mx.array, drafted: Sequence[int], key: mx.array
) -> tuple[mx.array, mx.array]:
    """For k drafted tokens, p (k+1, V) and q (k, V): whether each is accepted (k,), and
    for each position the token drawn there should it be the first rejected (k+1,: the
    residual's draw, then p's own draw after the last drafted token). Positions are
    judged independently; the caller reads them in order up to the first rejection."""
    k = len(drafted)
    accept_key, draw_key = mx.random.split(key)
    index = mx.array(list(drafted), dtype=mx.int32)[:, None]
    p_x = mx.take_along_axis(p[:k], index, axis=-1)[:, 0]
    q_x = mx.take_along_axis(q, index, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,), key=accept_key)
    accept = u * q_x < p_x  # u < p(x) / q(x), with q(x) > 0 for a token drawn from q
    residual = mx.concatenate([mx.maximum(p[:k] - q, 0.0), p[k:]], axis=0)
    again = mx.random.categorical(mx.log(residual), axis=-1, key=draw_key)  # log 0: -inf
    return accept, again.astype(mx.int32)


def checked_tokens(
    logits: mx.array, drafted: Sequence[int], q: mx.array, key: mx.array, params: SamplingParams
) -> list[int]:
    """A row's output tokens for one verify step: the drafted tokens accepted, then the
    token drawn at the first rejection (or after the last drafted token). `logits`: the
    target's, (k+1, V), from the position after the last known token on."""
    p = probabilities(logits, params)
    accept, again = judge(p, q, drafted, key)
    mx.eval(accept, again)
    ok: list[bool] = accept.tolist()  # type: ignore[assignment]
    drawn: list[int] = again.tolist()  # type: ignore[assignment]
    out: list[int] = []
    for j, token in enumerate(drafted):
        if not ok[j]:
            return [*out, drawn[j]]
        out.append(token)
    return [*out, drawn[len(drafted)]]
