"""Drafts drawn from an MTP head's distribution (runtime/batch/mtp.py), checked by
rejection sampling (runtime/batch/rejection.py), keep the target's distribution: the
first drafted token's empirical distribution over 300 seeded requests matches the exact
one (chi-square), on a tiny GLM-4.5 whose head is near the target's next-token
distribution and not equal to it (about 40% of drafts accepted). The same test catches
a verifier that keeps every draft or draws a rejected draft's token again from p.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import pytest

from runtime.batch import speculative
from runtime.batch.mtp import MTPDrafter
from runtime.batch.rejection import judge, probabilities
from runtime.load.loader import load
from runtime.types import GenerationRequest, SamplingParams

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.runtime.batch.test_draft_model import chi_square, chi_square_limit
from tests.runtime.batch.test_mtp import _engine
from tests.support.engine_kinds import collect, prompt
from tests.support.tiny_mtp import TARGETS, make_tiny_mtp


def _broken(how: str) -> Callable[..., list[int]]:
    """A verifier that keeps every drafted token (`keeps`), or at a rejection draws again
    from p rather than from max(p - q, 0) (`redraws`)."""

    def checked(logits: mx.array, drafted: Sequence[int], q: mx.array, key: mx.array,
                params: SamplingParams) -> list[int]:  # fmt: skip
        p = probabilities(logits, params)
        if how == "keeps":
            last: list[int] = mx.random.categorical(mx.log(p[-1:]), key=key).tolist()  # type: ignore[assignment]
            return [*drafted, last[0]]
        accept, _ = judge(p, q, drafted, key)
        again = mx.random.categorical(mx.log(p), axis=-1, key=mx.random.split(key)[1])
        ok: list[bool] = accept.tolist()  # type: ignore[assignment]
        drawn: list[int] = again.tolist()  # type: ignore[assignment]
        out: list[int] = []
        for j, token in enumerate(drafted):
            if not ok[j] and drawn[j] != token:  # (drawn again as the draft: kept)
                return [*out, drawn[j]]
            out.append(token)
        return [*out, drawn[len(drafted)]]

    return checked


def _sampled_fit(folder: Path, verifier: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """300 seeded requests of 3 tokens: whether the second token (the first drafted one,
    drawn from the head's q) is distributed as the target's p by its rank there and by
    whether p gives it more than q does (a rejected draft's token is drawn again from
    where p exceeds q)."""
    params = SamplingParams(temperature=1.0, top_k=4)
    tokens = prompt(12, 95, TARGETS[NEAR][1])
    counter = iter(range(1, 1 << 30))  # every unseeded key, the rows' and the head's
    monkeypatch.setattr(secrets, "randbits", lambda _: next(counter))
    if verifier != "exact":
        monkeypatch.setattr(speculative, "checked_tokens", _broken(verifier))
    n = 300
    engine = _engine(folder, "mtp")
    try:
        request = GenerationRequest(tokens, 3, params, prefill_chunk=16)
        runs = [collect(engine.submit(request)) for _ in range(n)]
    finally:
        engine.stop()
    assert all(done.stats.drafted_tokens > 0 for _, done in runs)
    drafter = MTPDrafter(load(folder, mtp=True).model)
    model = drafter.model
    dists: dict[int, tuple[dict[int, float], dict[int, float]]] = {}
    ranks, want_ranks = [0] * 4, [0.0] * 4
    liked, want_liked = 0, 0.0
    for run, _ in runs:
        if run[0] not in dists:
            seq = [*tokens, run[0]]
            hidden = model.forward(mx.array(seq)[None], model.make_caches())
            p = probabilities(model.logits(hidden[:, -1, :]), params)[0]
            _, head = drafter.run(hidden[:, :-1], mx.array(seq[1:])[None], model.mtp_cache())
            q = probabilities(head, params)[0]
            dists[run[0]] = (_support(p), _support(q))
        p_of, q_of = dists[run[0]]
        if run[1] not in p_of:
            return False  # a token p never draws
        order = sorted(p_of, key=lambda t: -p_of[t])
        ranks[order.index(run[1])] += 1
        for r, t in enumerate(order):
            want_ranks[r] += p_of[t]
        more = {t for t in p_of if p_of[t] > q_of.get(t, 0.0)}
        liked += run[1] in more
        want_liked += sum(p_of[t] for t in more)
    fits = (
        chi_square(ranks, want_ranks),
        chi_square([liked, n - liked], [want_liked, n - want_liked]),
    )
    return all(stat < chi_square_limit(df) for stat, df in fits)


def _support(dist: mx.array) -> dict[int, float]:
    values: list[float] = dist.tolist()  # type: ignore[assignment]
    return {t: v for t, v in enumerate(values) if v > 0}


NEAR = "glm4_moe"


@pytest.fixture(scope="module")
def near(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head near the target's next token's distribution, not equal to it."""
    return make_tiny_mtp(NEAR, tmp_path_factory.mktemp("near"), agree=True, noise=NOISE)


NOISE = 0.05


@pytest.mark.parametrize("verifier", ["exact", "keeps", "redraws"])
def test_sampled_drafts_from_the_head_keep_the_target_distribution(
    verifier: str, near: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts drawn from the head's distribution, checked by rejection sampling, keep the
    target's; a verifier that keeps every draft, or draws a rejected draft's token again
    from p, is caught by the same test."""
    assert _sampled_fit(near, verifier, monkeypatch) is (verifier == "exact")
