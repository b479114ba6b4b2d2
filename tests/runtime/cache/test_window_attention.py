"""A sliding-window layer's batch (rows left-padded in one buffer, runtime/cache/batch.py)
attends through the CPU primitive with one first key per row (`first_keys`: its padding
and what left the window skipped) instead of a (B, 1, L, K) mask through MLX's ops; the
same numbers as the mask, and the mask where one first key per row cannot say it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime import kernels as cpu_kernels
from runtime.cache import BatchTokenCache, KVCache, RotatingKVCache
from runtime.models.base import cache_attention

HEADS, KV_HEADS, DIM, WINDOW = 4, 2, 64, 16
SCALE = DIM**-0.5


def _batch(lengths: tuple[int, ...], seed: int) -> BatchTokenCache:
    """Rows of `lengths` tokens in sliding-window caches, joined into one batch."""
    rng = np.random.default_rng(seed)
    batch = BatchTokenCache(RotatingKVCache(max_size=WINDOW))
    for n in lengths:
        row = RotatingKVCache(max_size=WINDOW)
        k, v = (rng.normal(size=(1, KV_HEADS, n, DIM)).astype(np.float32) for _ in "kv")
        row.update_and_fetch(mx.array(k), mx.array(v))
        batch.add(row)
    return batch


def _reference(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    """MLX's attention under the cache's own mask (None: every key seen)."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)


@pytest.mark.parametrize(
    ("lengths", "length"),
    [
        ((3, 9, 30), 1),  # one row past its window, one not, padding in both
        ((40, 40), 1),  # every row past its window
        ((2, 5, 7), 4),  # a block whose window does not bind: one first key per row
        ((12, 20), 4),  # a block whose window binds: each query its own first key
    ],
)
def test_a_windowed_batch_attends_as_its_mask_says(
    lengths: tuple[int, ...], length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not cpu_kernels.rows_ready():
        pytest.skip("no CPU primitives here")
    calls: list[object] = []
    attend = cpu_kernels.attend

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("starts"))
        return attend(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "attend", counted)
    rng = np.random.default_rng(len(lengths) * 10 + length)
    rows = len(lengths)
    q = mx.array(rng.normal(size=(rows, HEADS, length, DIM)).astype(np.float32))
    k, v = (
        mx.array(rng.normal(size=(rows, KV_HEADS, length, DIM)).astype(np.float32)) for _ in "kv"
    )
    with mx.stream(mx.cpu):
        ours_cache, ref_cache = _batch(lengths, 1), _batch(lengths, 1)
        starts = ours_cache.first_keys(length)
        binds = any(n + length > WINDOW for n in lengths)
        assert (starts is None) == (length > 1 and binds)
        got = cache_attention(q, k, v, ours_cache, scale=SCALE, window=WINDOW)  # type: ignore[arg-type]
        assert calls == ([] if starts is None else [starts])  # the primitive, or the mask
        mask = ref_cache.make_mask(length, WINDOW)
        assert not isinstance(mask, str)
        keys, values = ref_cache.update_and_fetch(k, v)
        groups = HEADS // KV_HEADS
        want = _reference(
            q, mx.repeat(keys, groups, axis=1), mx.repeat(values, groups, axis=1), mask
        )
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_first_keys_without_a_window_are_the_padding() -> None:
    batch = BatchTokenCache(KVCache())
    for n in (3, 8):
        row = KVCache()
        row.update_and_fetch(mx.zeros((1, 1, n, 8)), mx.zeros((1, 1, n, 8)))
        batch.add(row)
    assert batch.first_keys(1) == [5, 0]
    assert batch.first_keys(6) == [5, 0]
    assert batch.first_keys(1, window=4) == [max(5, 9 - 4), 9 - 4]
