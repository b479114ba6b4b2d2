"""A prompt's prefill keeps a hybrid model's recurrent states at the prefix trie's snapshot
points inside a chunk (runtime/batch/prompt_prefill.py, `RecurrentCache.capture`), instead of
cutting the chunk into one forward per point; what it keeps equals the state of a run
that stopped there, and restores from it give the cold run's logits."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.batch import generate
from runtime.batch.prompt_prefill import PromptPrefill
from runtime.cache import KVCache, LayerCache, RecurrentCache, RecurrentSnapshot
from runtime.models import LanguageModel
from runtime.prefix.cache import PrefixCache
from tests.support.model_checks import TinyModels, forward, random_tokens
from tests.support.tiny_hybrid import VOCAB, make_tiny
from tests.support.tiny_models import load_mlx
from tests.support.tiny_models import make_tiny as make_dense

ATOL = 1e-4
BIG = 10**9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_tiny)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in random_tokens(VOCAB, n, seed)[0]]


class _Counting:
    """The model, counting its forwards."""

    def __init__(self, model: LanguageModel) -> None:
        self.model, self.forwards = model, 0

    def forward(self, tokens: mx.array, caches: Any) -> mx.array:
        self.forwards += 1
        return self.model.forward(tokens, caches)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.model.logits(hidden)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_chunk_keeps_the_states_at_the_offsets_asked(name: str, tiny: TinyModels) -> None:
    model = load_mlx(tiny[name][1])
    tokens = np.array([_prompt(40, seed=5)], np.int32)
    caches = model.make_caches()
    forward(model, tokens[:, :6], caches)
    recurrent = [c for c in caches if isinstance(c, RecurrentCache)]
    for c in recurrent:
        c.capture((7, 13, 30, 46))  # 46 lies past the chunk: not kept
    forward(model, tokens[:, 6:], caches)
    for at in (7, 13, 30):
        stopped = model.make_caches()
        forward(model, tokens[:, :at], stopped)
        alone = [c for c in stopped if isinstance(c, RecurrentCache)]
        for live, ref in zip(recurrent, alone, strict=True):
            snap = live.snapshot(0, at=at)
            assert isinstance(snap, RecurrentSnapshot) and snap.end == at
            assert ref.conv_state is not None and ref.recurrent_state is not None
            np.testing.assert_allclose(snap.conv_state, ref.conv_state, atol=1e-5)
            np.testing.assert_allclose(snap.recurrent_state, ref.recurrent_state, atol=1e-5)
    assert all(c.snapshot(0, at=46) is None and c.offset == 40 for c in recurrent)


def _prefill(
    pc: PrefixCache[LayerCache], model: _Counting, prompt: list[int], chunk: int
) -> tuple[int, Any]:
    """Begin `prompt`, read it in chunks of `chunk` the way the scheduler does; return
    (tokens reused, the lease)."""
    lease = pc.begin(prompt)
    reading = PromptPrefill(lease, prompt)
    while not reading.done:
        reading.run(model, chunk, lambda at: pc.snapshot_at(lease, at))
    return lease.reused, lease


def test_snapshot_points_inside_a_chunk_cost_no_forward(tiny: TinyModels) -> None:
    model = load_mlx(tiny["qwen3_5"][1])
    counting = _Counting(model)
    pc: PrefixCache[LayerCache] = PrefixCache(
        model.make_caches, budget_bytes=BIG, snapshot_interval=8, tail_keep=2
    )
    first = _prompt(30, seed=6)
    reused, lease = _prefill(pc, counting, first, 64)
    assert reused == 0 and {8, 16, 24, 28} == set(lease.snapshot_points)
    assert counting.forwards == 1  # one forward over all 29 tokens, the points kept on the way
    pc.end(lease, first[:29])
    pc.verify()
    # a branch off the first prompt at 20 restores the state kept at 16, and goes on
    # from there as a run from scratch does
    branch = [*first[:20], 1, 2, 3, 4]
    lease = pc.begin(branch)
    assert lease.reused == 16
    got = forward(model, np.array([branch[16:]], np.int32), lease.caches)
    cold = forward(model, np.array([branch], np.int32), model.make_caches())[:, 16:]
    np.testing.assert_allclose(got, cold, atol=ATOL, rtol=0)
    pc.end(lease, branch)
    pc.verify()


def test_a_sliding_window_still_stops_at_each_point(tmp_path_factory: Any) -> None:
    # gemma3's rotating caches cannot say where they were, so its chunks stop there
    models = TinyModels(tmp_path_factory, make_dense)
    model = load_mlx(models["gemma3_text"][1])
    counting = _Counting(model)
    pc: PrefixCache[LayerCache] = PrefixCache(
        model.make_caches, budget_bytes=BIG, snapshot_interval=8, tail_keep=2
    )
    prompt = _prompt(30, seed=7)
    _, lease = _prefill(pc, counting, prompt, 64)
    inside = [p for p in lease.snapshot_points if 0 < p < len(prompt) - 1]
    if not inside:
        pytest.skip("gemma3's window rewinds here: no snapshot points")
    assert counting.forwards == len(inside) + 1


def test_a_long_prompt_fills_one_reserved_buffer(tmp_path_factory: Any) -> None:
    # every KV layer makes room for the whole prompt before the first chunk: chunks then
    # write into one buffer instead of copying the cache each time it grows
    models = TinyModels(tmp_path_factory, make_dense)
    model = load_mlx(models["llama"][1])
    pc: PrefixCache[LayerCache] = PrefixCache(model.make_caches, budget_bytes=BIG)
    prompt = _prompt(700, seed=8)
    lease = pc.begin(prompt)
    reading = PromptPrefill(lease, prompt)
    reading.run(_Counting(model), 100, lambda at: None)
    capacities = {
        c.keys.shape[2] for c in lease.caches if isinstance(c, KVCache) and c.keys is not None
    }
    assert capacities == {768}  # 700 rounded up to the 256-token step, not 256
    while not reading.done:
        reading.run(_Counting(model), 100, lambda at: None)
    got = forward(model, np.array([prompt[-1:]], np.int32), lease.caches)
    cold = forward(model, np.array([prompt], np.int32), model.make_caches())[:, -1:]
    np.testing.assert_allclose(got, cold, atol=ATOL, rtol=0)
    pc.discard(lease)


def test_the_single_sequence_prefill_reserves_too(tmp_path_factory: Any) -> None:
    models = TinyModels(tmp_path_factory, make_dense)
    model = load_mlx(models["llama"][1])
    caches = model.make_caches()
    prompt = _prompt(700, seed=9)
    generate.prefill(model, caches, prompt[:40])  # a turn the caches already hold
    seen: list[set[int]] = []  # the layers' capacities after the first chunk

    def first_chunk(_: int) -> None:
        seen.append(
            {c.keys.shape[2] for c in caches if isinstance(c, KVCache) and c.keys is not None}
        )

    rest = generate.prefill(
        model, caches, prompt[39:], chunk=100, offset=39, pauses=(139,), on_pause=first_chunk
    )
    assert rest == prompt[-1:]
    assert seen == [{768}]  # 700 rounded up to the 256-token step, not 256
    got = forward(model, np.array([rest], np.int32), caches)
    cold = forward(model, np.array([prompt], np.int32), model.make_caches())[:, -1:]
    np.testing.assert_allclose(got, cold, atol=ATOL, rtol=0)
