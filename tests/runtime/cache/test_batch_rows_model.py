"""A tiny model's steps over a running batch whose rows keep buffers of their own
(runtime/cache/rows.py) give the logits of the left-padded layout, bit for bit: plain
and 8-bit caches, decode steps, a verify step and its rewind, rows leaving and joining."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime import kernels as cpu_kernels
from runtime.cache import BatchCaches, BatchQuantizedRows, RowTokenCache, quantizing
from runtime.models.base import rows_layout
from tests.support.tiny_models import load_mlx, make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("llama")
    make_tiny("llama", folder, seed=3)
    return load_mlx(folder)


def _tokens(vocab: int, rows: int, length: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(3, vocab, size=(rows, length)).astype(np.int32))


def _joined(model: Any, make: Callable[[], list[Any]], lengths: Sequence[int], rows: bool) -> Any:
    batch = BatchCaches(make(), rows=rows)
    for i, n in enumerate(lengths):
        caches = make()
        model.forward(_tokens(model.args.vocab_size, 1, n, 30 + i), caches)
        mx.eval([a for c in caches for a in c.state])
        batch.add(caches)
    return batch


def _logits(model: Any, batch: BatchCaches, tokens: mx.array) -> np.ndarray[Any, Any]:
    logits = model.logits(model.forward(tokens, batch.layers))
    mx.eval(logits, [a for layer in batch.layers for a in layer.state])
    return np.array(logits)


@pytest.mark.parametrize("bits", [None, 8])
def test_a_step_over_rows_of_their_own_has_the_padded_layouts_bits(
    bits: int | None, model: Any
) -> None:
    """Decode steps, a verify step of 4 tokens a row and its rewind, a row leaving and one
    joining: the logits equal the left-padded layout's, bit for bit."""
    make = quantizing(model.make_caches, bits)
    # where the extension runs, the batch keeps its rows apart and the kernels read them
    assert rows_layout(model, make()) == (cpu_kernels.extension() is not None)
    lengths = [40, 7, 300, 13]  # 300: past a growth step and the kernel's chunk
    own, padded = (_joined(model, make, lengths, rows) for rows in (True, False))
    kinds = (RowTokenCache, BatchQuantizedRows)
    assert isinstance(own.layers[0], kinds) and not isinstance(padded.layers[0], kinds)
    vocab = model.args.vocab_size

    def same(tokens: mx.array) -> None:
        np.testing.assert_array_equal(_logits(model, own, tokens), _logits(model, padded, tokens))

    for step in range(3):
        same(_tokens(vocab, 4, 1, 50 + step))
    same(_tokens(vocab, 4, 4, 60))  # a verify step; two of its columns rejected
    for batch in (own, padded):
        batch.rewind(2)
    same(_tokens(vocab, 4, 1, 61))
    for batch in (own, padded):  # the longest row leaves
        batch.row(2)
        batch.remove([2])
    same(_tokens(vocab, 3, 1, 62))
    for batch in (own, padded):  # and a longer one joins
        caches = make()
        model.forward(_tokens(vocab, 1, 520, 63), caches)
        mx.eval([a for c in caches for a in c.state])
        batch.add(caches)
    for step in range(2):
        same(_tokens(vocab, 4, 1, 70 + step))
    assert own.nbytes < padded.nbytes
