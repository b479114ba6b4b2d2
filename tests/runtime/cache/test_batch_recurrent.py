"""A running batch's recurrent layers go back into a forward (runtime/cache/
batch_recurrent.py): asked before it (`BatchCaches.keep_steps`), they keep their states
after each position, and `rewind` brings every row to the state after the tokens kept,
the state decoding those tokens one step at a time gives (up to the rounding of a
matrix product of more rows: the BLAS's, on a model this small); without it, they
refuse. Greedy identity in the engine: tests/runtime/batch/test_speculative.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.cache import BatchCaches, RecurrentCache
from runtime.cache.batch_recurrent import BatchRecurrentCache
from tests.support.model_checks import TinyModels, forward, random_tokens
from tests.support.tiny_hybrid import VOCAB, make_tiny
from tests.support.tiny_models import load_mlx


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_tiny)


def _batch(model: Any, lengths: Sequence[int]) -> BatchCaches:
    """Rows of prompts of these lengths (random tokens), each read into caches of its
    own, joined in one batch."""
    batch = None
    for i, n in enumerate(lengths):
        caches = model.make_caches()
        forward(model, random_tokens(VOCAB, n, seed=20 + i), caches)
        batch = BatchCaches(caches) if batch is None else batch
        batch.add(caches)
    assert batch is not None
    return batch


def _step(model: Any, batch: BatchCaches, tokens: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """One forward of (B, L) tokens; the logits, evaluated."""
    logits = model.logits(model.forward(mx.array(tokens), batch.layers))
    mx.eval(logits, [a for layer in batch.layers for a in layer.state])
    return np.array(logits)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_verify_forward_rewinds_to_any_position(name: str, tiny: TinyModels) -> None:
    model = load_mlx(tiny[name][1])
    fed = random_tokens(VOCAB, 5, seed=7, batch=2)
    after = random_tokens(VOCAB, 1, seed=8, batch=2)
    for kept in (1, 3, 5):
        batch = _batch(model, [9, 14])  # rows of different lengths: left padding
        batch.keep_steps()
        _step(model, batch, fed)
        batch.rewind(5 - kept)
        # the reference decodes the kept tokens one step at a time
        ref = _batch(model, [9, 14])
        for j in range(kept):
            _step(model, ref, fed[:, j : j + 1])
        for ours, theirs in zip(batch.layers, ref.layers, strict=True):
            np.testing.assert_array_equal(np.array(ours.offset), np.array(theirs.offset))
            if isinstance(ours, BatchRecurrentCache):
                assert isinstance(theirs, BatchRecurrentCache)
                for a, b in zip(ours.state, theirs.state, strict=True):
                    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)
        # and the next step reads on from there as decoding does
        np.testing.assert_allclose(
            _step(model, batch, after), _step(model, ref, after), atol=1e-4, rtol=0
        )
        row = batch.row(1)
        assert all(c.offset == 14 + kept + 1 for c in row)
        assert any(isinstance(c, RecurrentCache) for c in row)


def test_recurrent_layers_rewind_only_into_a_forward_that_kept_its_steps(
    tiny: TinyModels,
) -> None:
    model = load_mlx(tiny["qwen3_5"][1])
    batch = _batch(model, [6, 8])
    _step(model, batch, random_tokens(VOCAB, 3, seed=9, batch=2))
    with pytest.raises(ValueError, match="no state was kept"):
        batch.rewind(1)
    batch.rewind(0)  # nothing to take back: always fine
    batch.keep_steps()
    _step(model, batch, random_tokens(VOCAB, 3, seed=10, batch=2))
    with pytest.raises(ValueError, match="no state was kept"):
        batch.rewind(4)  # further back than the forward went
    # a plain step after a kept one drops what it kept
    batch.keep_steps()
    _step(model, batch, random_tokens(VOCAB, 3, seed=11, batch=2))
    _step(model, batch, random_tokens(VOCAB, 1, seed=12, batch=2))
    with pytest.raises(ValueError, match="no state was kept"):
        batch.rewind(1)
