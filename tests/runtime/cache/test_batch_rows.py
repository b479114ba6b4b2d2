"""A running batch's rows in buffers of their own (runtime/cache/rows.py): the batch holds
about the sum of its rows' lengths, not rows x the longest; rows join and leave without
a copy and come out as they went in; a row's writes never show in the tokens of the
cache it came from. A model's steps over them: test_batch_rows_model.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime import kernels as cpu_kernels
from runtime.cache import (
    BatchCaches,
    BatchQuantizedCache,
    BatchQuantizedRows,
    BatchTokenCache,
    KVCache,
    QuantizedKVCache,
    RowTokenCache,
)

HEADS, DIM = 2, 64
STEP = 256  # the caches' growth


def _filled(bits: int | None, n: int, seed: int) -> KVCache | QuantizedKVCache:
    """A cache of `bits` (None: float) holding n random tokens."""
    rng = np.random.default_rng(seed)
    k, v = (mx.array(rng.normal(size=(1, HEADS, n, DIM)).astype(np.float32)) for _ in "kv")
    cache: KVCache | QuantizedKVCache = KVCache() if bits is None else QuantizedKVCache(bits)
    cache.update_and_fetch(k, v)
    mx.eval(cache.state)
    return cache


def _decode(batch: BatchCaches, steps: int, seed: int) -> None:
    """`steps` one-token steps for every row of the batch's one layer, as the models
    layer writes them (runtime/models/base.py)."""
    layer = batch.layers[0]
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        shape = (batch.rows, HEADS, 1, DIM)
        k, v = (mx.array(rng.normal(size=shape).astype(np.float32)) for _ in "kv")
        if isinstance(layer, RowTokenCache):
            layer.extend([k, v], cpu_kernels.append_rows)
        elif isinstance(layer, BatchQuantizedRows):
            layer.extend(k, v, cpu_kernels.append_rows)
        else:
            assert isinstance(layer, (BatchTokenCache, BatchQuantizedCache))
            layer.update_and_fetch(k, v)
        mx.eval(layer.state)


@pytest.mark.parametrize("bits", [None, 8])
def test_a_batch_holds_about_the_sum_of_its_rows_lengths(bits: int | None) -> None:
    """One 3000-token row among three short ones: the padded layout holds four rows of
    3000 columns, rows of their own the 3060 tokens and less than a growth step each."""
    lengths = (3000, 10, 20, 30)

    def batch(rows: bool) -> BatchCaches:
        out = BatchCaches([_filled(bits, 1, 0)], rows=rows)
        for i, n in enumerate(lengths):
            out.add([_filled(bits, n, 1 + i)])
        _decode(out, 8, seed=9)
        return out

    own, padded = batch(True), batch(False)
    per_token, _ = own.bytes_per_token()
    assert per_token == padded.bytes_per_token()[0] > 0
    assert own.padded_bytes_per_token() == 0 and padded.padded_bytes_per_token() == per_token
    held = sum(lengths) + 8 * len(lengths)
    assert held * per_token <= own.nbytes < (held + len(lengths) * STEP) * per_token
    assert padded.nbytes >= len(lengths) * (3000 + 8) * per_token


def test_rows_join_and_leave_without_a_copy_and_come_out_as_they_went_in() -> None:
    long, short = _filled(None, 3000, 1), _filled(None, 20, 2)
    assert isinstance(long, KVCache) and isinstance(short, KVCache)
    assert long.keys is not None and short.keys is not None
    before = [np.array(long.keys[..., :3000, :]), np.array(short.keys[..., :20, :])]
    batch = BatchCaches([KVCache()], rows=True)
    mx.eval(batch.layers[0].state)
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    batch.add([long])
    batch.add([short])
    _decode(batch, 3, seed=4)  # in place: no row is copied
    back = batch.row(0)[0]
    batch.remove([0])
    mx.eval(back.state)
    assert mx.get_peak_memory() - start < long.nbytes // 4
    assert isinstance(back, KVCache) and back.offset == 3003 and back.keys is not None
    np.testing.assert_array_equal(np.array(back.keys[..., :3000, :]), before[0])
    # the caches they came from hold the tokens they held
    for cache, held in zip((long, short), before, strict=True):
        assert cache.keys is not None
        np.testing.assert_array_equal(np.array(cache.keys[..., : cache.offset, :]), held)
    views = batch.views(0)
    assert views is not None
    keys = views[0][0]
    assert isinstance(keys, mx.array) and keys.shape[2] == 23
