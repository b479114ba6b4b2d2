"""Sampler semantics against numpy references and empirical distributions."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from runtime.text.sampling import (
    Sampler,
    SampleResult,
    apply_min_p,
    apply_top_k,
    apply_top_p,
)
from runtime.types import ReasoningBudget, SamplingParams

V = 64


def _logits(seed: int, vocab: int = V, scale: float = 3.0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(0.0, scale, size=(1, vocab)).astype(np.float32))


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    out: np.ndarray = x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    return out


def _tok(r: SampleResult) -> int:
    return int(np.array(r.token)[0])


def _lp(r: SampleResult) -> float:
    return float(np.array(r.logprob)[0])


def _run(sampler: Sampler, logits: mx.array, steps: int) -> list[int]:
    return [_tok(sampler.sample(logits)) for _ in range(steps)]


def test_greedy_equals_argmax() -> None:
    for seed in range(10):
        logits = _logits(seed)
        r = Sampler(SamplingParams(temperature=0.0), V, []).sample(logits)
        assert r.token.shape == (1,) and r.token.dtype == mx.int32
        assert _tok(r) == int(np.argmax(np.array(logits)))
        assert r.top_ids is None and r.top_logprobs is None


def test_bf16_logits_accepted() -> None:
    logits = _logits(0).astype(mx.bfloat16)
    r = Sampler(SamplingParams(temperature=0.0), V, []).sample(logits)
    assert r.logprob.dtype == mx.float32
    assert _tok(r) == int(np.argmax(np.array(logits.astype(mx.float32))))


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0])
def test_top_k_one_is_greedy(temperature: float) -> None:
    for seed in range(5):
        logits = _logits(seed)
        params = SamplingParams(temperature=temperature, top_k=1, seed=seed)
        assert _run(Sampler(params, V, []), logits, 5) == [int(np.argmax(np.array(logits)))] * 5


def test_seed_reproducible_and_distinct() -> None:
    logits = _logits(1, scale=1.0)
    a = _run(Sampler(SamplingParams(temperature=1.0, seed=7), V, []), logits, 50)
    b = _run(Sampler(SamplingParams(temperature=1.0, seed=7), V, []), logits, 50)
    c = _run(Sampler(SamplingParams(temperature=1.0, seed=8), V, []), logits, 50)
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # really sampling, not stuck


def test_seed_does_not_touch_global_rng() -> None:
    mx.random.seed(123)
    expected = np.array(mx.random.uniform(shape=(4,)))
    mx.random.seed(123)
    _run(Sampler(SamplingParams(temperature=1.0, seed=3), V, []), _logits(2), 5)
    _run(Sampler(SamplingParams(temperature=1.0), V, []), _logits(2), 5)
    assert np.array_equal(np.array(mx.random.uniform(shape=(4,))), expected)


def test_unseeded_runs_differ() -> None:
    logits = _logits(1, scale=0.5)
    a = _run(Sampler(SamplingParams(temperature=1.0), V, []), logits, 30)
    b = _run(Sampler(SamplingParams(temperature=1.0), V, []), logits, 30)
    assert a != b


def test_logit_bias_forces_and_bans() -> None:
    logits = _logits(3)
    best = int(np.argmax(np.array(logits)))
    target = (best + 1) % V
    forced = SamplingParams(temperature=1.0, seed=0, logit_bias={target: 100.0})
    assert set(_run(Sampler(forced, V, []), logits, 20)) == {target}
    banned = SamplingParams(temperature=0.0, logit_bias={best: -1e9})
    assert _tok(Sampler(banned, V, []).sample(logits)) != best
    # logprobs stay those of the unmodified distribution
    r = Sampler(SamplingParams(temperature=0.0, logit_bias={target: 100.0}), V, []).sample(logits)
    ref = _np_log_softmax(np.array(logits))[0, target]
    assert _lp(r) == pytest.approx(float(ref), abs=1e-5)


def test_logit_bias_out_of_range_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler(SamplingParams(logit_bias={V: 1.0}), V, [])
    with pytest.raises(ValueError):
        Sampler(SamplingParams(logit_bias={-1: 1.0}), V, [])


def _np_penalize(
    logits: np.ndarray,
    prompt: list[int],
    generated: list[int],
    rep: float,
    presence: float,
    frequency: float,
    bias: dict[int, float],
) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for t, b in bias.items():
        x[0, t] += b
    for t in set(prompt) | set(generated):
        x[0, t] = x[0, t] / rep if x[0, t] > 0 else x[0, t] * rep
    counts = Counter(generated)
    for t, c in counts.items():
        x[0, t] -= presence + frequency * c
    return x


@pytest.mark.parametrize(
    ("rep", "presence", "frequency"),
    [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 0.4), (1.2, 0.5, 0.3), (0.8, -0.5, -0.2)],
)
def test_penalties_match_numpy(rep: float, presence: float, frequency: float) -> None:
    rng = np.random.default_rng(42)
    for trial in range(4):
        prompt = [int(t) for t in rng.integers(0, V, size=12)]
        # A long greedy run with penalties exercises the device-side counts over many steps.
        logits_seq = [_logits(100 * trial + i) for i in range(25)]
        bias = {int(rng.integers(0, V)): 2.0}
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=rep,
            presence_penalty=presence,
            frequency_penalty=frequency,
            logit_bias=bias,
        )
        sampler = Sampler(params, V, prompt)
        generated: list[int] = []
        for logits in logits_seq:
            ref = _np_penalize(np.array(logits), prompt, generated, rep, presence, frequency, bias)
            got = _tok(sampler.sample(logits))
            assert got == int(np.argmax(ref))
            generated.append(got)


def test_penalty_transform_values_match_numpy() -> None:
    """The adjusted logits themselves, not just their argmax."""
    rng = np.random.default_rng(5)
    prompt = [1, 2, 3, 3]
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2
    )
    sampler = Sampler(params, V, prompt)
    history = [int(t) for t in rng.integers(0, 8, size=10)]
    for t in history:
        sampler._record(mx.array([t], dtype=mx.int32))
    logits = _logits(9)
    got = np.array(sampler._adjust(logits))
    ref = _np_penalize(np.array(logits), prompt, history, 1.5, 0.3, 0.2, {})
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def _empirical(params: SamplingParams, logits: mx.array, draws: int) -> Counter[int]:
    sampler = Sampler(params, logits.shape[-1], [])
    tokens = []
    for _ in range(draws):
        r = sampler.sample(logits)
        mx.async_eval(r.token)
        tokens.append(r.token)
    return Counter(int(t) for t in np.array(mx.concatenate(tokens)))


def _assert_proportional(counts: Counter[int], probs: dict[int, float], draws: int) -> None:
    """Loose chi-square: the statistic stays far below what a wrong distribution gives."""
    total = sum(probs.values())
    chi2 = 0.0
    for t, p in probs.items():
        expected = draws * p / total
        chi2 += (counts.get(t, 0) - expected) ** 2 / expected
    dof = max(len(probs) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, counts, probs)


def test_top_p_nucleus_empirical() -> None:
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02], dtype=np.float64)
    logits = mx.array(np.log(probs).astype(np.float32)[None, :])
    draws = 2000
    counts = _empirical(SamplingParams(temperature=1.0, top_p=0.75, seed=1), logits, draws)
    # mass before token 2 is 0.65 < 0.75, before token 3 is 0.80: nucleus is {0, 1, 2}
    assert set(counts) <= {0, 1, 2}
    _assert_proportional(counts, {0: 0.4, 1: 0.25, 2: 0.15}, draws)


def test_min_p_empirical() -> None:
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02], dtype=np.float64)
    logits = mx.array(np.log(probs).astype(np.float32)[None, :])
    draws = 2000
    counts = _empirical(SamplingParams(temperature=1.0, min_p=0.3, seed=2), logits, draws)
    # threshold 0.3 * 0.4 = 0.12: tokens 0, 1, 2 survive
    assert set(counts) <= {0, 1, 2}
    _assert_proportional(counts, {0: 0.4, 1: 0.25, 2: 0.15}, draws)


def test_top_k_and_temperature_empirical() -> None:
    probs = np.array([0.3, 0.25, 0.2, 0.15, 0.1], dtype=np.float64)
    logits = mx.array(np.log(probs).astype(np.float32)[None, :])
    draws = 2000
    counts = _empirical(SamplingParams(temperature=2.0, top_k=3, seed=3), logits, draws)
    assert set(counts) <= {0, 1, 2}
    # temperature 2 flattens: p ** 0.5
    _assert_proportional(counts, {i: math.sqrt(probs[i]) for i in range(3)}, draws)


def test_top_k_then_top_p_renormalises() -> None:
    """top_p sees the distribution left by top_k: over the top 4 the mass before token 2 is
    0.65 / 0.9 = 0.72 >= 0.7, so the nucleus is {0, 1} (it would be {0, 1, 2} without top_k)."""
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02], dtype=np.float64)
    logits = mx.array(np.log(probs).astype(np.float32)[None, :])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.7, min_p=0.01, seed=5)
    counts = _empirical(params, logits, 2000)
    assert set(counts) <= {0, 1}
    _assert_proportional(counts, {0: 0.4, 1: 0.25}, 2000)
    counts = _empirical(SamplingParams(temperature=1.0, top_k=5, min_p=0.3, seed=6), logits, 2000)
    assert set(counts) <= {0, 1, 2}
    _assert_proportional(counts, {0: 0.4, 1: 0.25, 2: 0.15}, 2000)


def test_plain_temperature_empirical() -> None:
    probs = np.array([0.5, 0.3, 0.2], dtype=np.float64)
    logits = mx.array(np.log(probs).astype(np.float32)[None, :])
    counts = _empirical(SamplingParams(temperature=1.0, seed=4), logits, 2000)
    _assert_proportional(counts, {0: 0.5, 1: 0.3, 2: 0.2}, 2000)


def test_filter_functions_keep_at_least_one() -> None:
    logits = _logits(11)
    best = int(np.argmax(np.array(logits)))
    for out in (apply_top_p(logits, 1e-6), apply_min_p(logits, 1.0), apply_top_k(logits, 1)):
        arr = np.array(out)[0]
        assert np.isfinite(arr).sum() == 1 and np.isfinite(arr[best])
    assert np.isfinite(np.array(apply_top_k(logits, 5))).sum() == 5


@pytest.mark.parametrize("k", [0, 1, 5, V])
def test_logprobs_match_numpy(k: int) -> None:
    logits = _logits(21)
    ref = _np_log_softmax(np.array(logits).astype(np.float64))[0]
    for params in (
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=k),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=True, top_logprobs=k, seed=1),
    ):
        r = Sampler(params, V, []).sample(logits)
        assert r.top_ids is not None and r.top_logprobs is not None
        assert r.top_ids.shape == (1, k) and r.top_logprobs.shape == (1, k)
        assert r.top_ids.dtype == mx.int32 and r.logprob.dtype == mx.float32
        t = _tok(r)
        assert _lp(r) == pytest.approx(ref[t], abs=1e-5)
        expected_ids = np.argsort(-ref, kind="stable")[:k]
        np.testing.assert_array_equal(np.array(r.top_ids)[0], expected_ids)
        np.testing.assert_allclose(np.array(r.top_logprobs)[0], ref[expected_ids], atol=1e-5)


def test_sample_does_not_sync() -> None:
    """The decode loop queues the next step before reading the token: sample() must accept a
    lazy input and return lazy outputs (nothing here forces evaluation)."""
    params = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=10,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.1,
        seed=0,
        logprobs=True,
        top_logprobs=3,
    )
    sampler = Sampler(params, V, [1, 2, 3])
    logits = _logits(0) * 1.0  # lazy
    results = [sampler.sample(logits + i) for i in range(3)]
    mx.async_eval(*[r.token for r in results])
    assert all(0 <= _tok(r) < V for r in results)


def test_invalid_params_rejected() -> None:
    for bad in (
        SamplingParams(top_p=0.0),
        SamplingParams(top_k=-1),
        SamplingParams(min_p=1.5),
        SamplingParams(repetition_penalty=0.0),
    ):
        with pytest.raises(ValueError):
            Sampler(bad, V, [])
    with pytest.raises(ValueError):
        Sampler(SamplingParams(repetition_penalty=1.2), V, [V + 3])


def _steered(script: list[int], vocab: int = V) -> list[mx.array]:
    """Logits whose argmax is each scripted token in turn."""
    rows = []
    for t in script:
        row = np.zeros(vocab, np.float32)
        row[t] = 5.0
        rows.append(mx.array(row))
    return rows


OPEN, CLOSE = 3, 4


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_reasoning_budget_closes_the_block_after_its_tokens(temperature: float) -> None:
    budget = ReasoningBudget(tokens=3, close_id=CLOSE, open_id=OPEN)
    params = SamplingParams(temperature=temperature, top_k=1, reasoning_budget=budget)
    sampler = Sampler(params, V, [])
    # the model opens the block, would reason forever, then answers
    script = [7, OPEN, 9, 9, 9, 9, 9, 11, 12]
    out = [_tok(sampler.sample(row)) for row in _steered(script)]
    # three reasoning tokens, then the close in place of the fourth; after it, the model
    assert out == [7, OPEN, 9, 9, 9, CLOSE, 9, 11, 12]


def test_reasoning_budget_starts_inside_and_leaves_a_short_block_alone() -> None:
    inside = ReasoningBudget(tokens=2, close_id=CLOSE, open_id=OPEN, inside=True)
    sampler = Sampler(SamplingParams(temperature=0, reasoning_budget=inside), V, [])
    out = [_tok(sampler.sample(row)) for row in _steered([9, 9, 9, 5])]
    assert out == [9, 9, CLOSE, 5]
    # a block the model closes itself within the budget is not touched, nor a later one
    roomy = ReasoningBudget(tokens=4, close_id=CLOSE, open_id=OPEN, inside=True)
    sampler = Sampler(SamplingParams(temperature=0, reasoning_budget=roomy), V, [])
    script = [9, CLOSE, 5, 5, 5, 5, 5, 5]
    assert [_tok(sampler.sample(row)) for row in _steered(script)] == script
    # the forced token's logprob is the model's own for that token
    sampler = Sampler(SamplingParams(temperature=0, reasoning_budget=inside), V, [])
    rows = _steered([9, 9, 9])
    results = [sampler.sample(row) for row in rows]
    expected = _np_log_softmax(np.array(rows[2]))[CLOSE]
    assert _tok(results[2]) == CLOSE and math.isclose(
        _lp(results[2]), float(expected), rel_tol=1e-5
    )
