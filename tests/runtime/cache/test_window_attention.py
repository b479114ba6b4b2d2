"""A sliding-window layer's batch (rows left-padded in one buffer, runtime/cache/batch.py)
attends through the CPU primitive, each query from its own first key (its row's padding
and what left its window skipped: decode_attention.c), instead of a (B, 1, L, K) mask
through MLX's ops: the same numbers as the mask; a verify block's queries the very bits
of the one-token steps at their columns; the mask only for a longer block whose window
binds (a prompt chunk)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime import kernels as cpu_kernels
from runtime.cache import BatchTokenCache, KVCache, RotatingKVCache
from runtime.models.base import cache_attention

HEADS, KV_HEADS, DIM, WINDOW = 4, 2, 64, 16
SCALE = DIM**-0.5


@pytest.fixture(autouse=True)
def _primitives() -> None:
    if not cpu_kernels.rows_ready():
        pytest.skip("no CPU primitives here")


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


def _new(rows: int, heads: int, length: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(size=(rows, heads, length, DIM)).astype(np.float32))


def _attend(cache: BatchTokenCache, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    return cache_attention(q, k, v, cache, scale=SCALE, window=WINDOW)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lengths", "length", "kernel"),
    [
        ((3, 9, 30), 1, True),  # one row past its window, one not, padding in both
        ((40, 40), 1, True),  # every row past its window
        ((2, 5, 7), 4, True),  # a verify block whose window does not bind
        ((12, 20), 4, True),  # a verify block whose window binds: a first key per query
        ((1, 2), 12, True),  # a longer verify block within the window
        ((12, 20), 20, False),  # a prompt-sized block (its window binds): the mask
    ],
)
def test_a_windowed_batch_attends_as_its_mask_says(
    lengths: tuple[int, ...], length: int, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    attend = cpu_kernels.attend

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("window"))
        return attend(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "attend", counted)
    rows = len(lengths)
    q = _new(rows, HEADS, length, 1)
    k, v = _new(rows, KV_HEADS, length, 2), _new(rows, KV_HEADS, length, 3)
    with mx.stream(mx.cpu):
        ours, ref = _batch(lengths, 4), _batch(lengths, 4)
        got = _attend(ours, q, k, v)
        assert len(calls) == int(kernel)
        if kernel:  # the window goes to the kernel over a decode step's queries only
            assert calls[0] == (WINDOW if length <= cpu_kernels.DECODE_MAX_LENGTH else None)
        mask = ref.make_mask(length, WINDOW)
        assert not isinstance(mask, str)
        keys, values = ref.update_and_fetch(k, v)
        groups = HEADS // KV_HEADS
        wide_k, wide_v = mx.repeat(keys, groups, axis=1), mx.repeat(values, groups, axis=1)
        want = mx.fast.scaled_dot_product_attention(q, wide_k, wide_v, scale=SCALE, mask=mask)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [(12, 20), (3, 30), (40,)])
def test_a_verify_block_gets_the_bits_of_its_decode_steps(lengths: tuple[int, ...]) -> None:
    """Speculative decoding checks drafted tokens against the logits decoding would
    have had: query l of a verify block over a sliding window equals, bit for bit, the
    one-token step at its column (each query its own first key, the same chunks)."""
    rows, length = len(lengths), 6
    q = _new(rows, HEADS, length, 5)
    k, v = _new(rows, KV_HEADS, length, 6), _new(rows, KV_HEADS, length, 7)
    with mx.stream(mx.cpu):
        block, steps = _batch(lengths, 8), _batch(lengths, 8)
        assert block.window_binds(length)
        together = np.array(_attend(block, q, k, v))
        for i in range(length):
            one = np.array(
                _attend(steps, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1])
            )
            assert np.array_equal(one[:, :, 0], together[:, :, i]), i


def test_window_binds_past_the_padding_only() -> None:
    batch = BatchTokenCache(KVCache())
    for n in (3, 8):
        row = KVCache()
        row.update_and_fetch(mx.zeros((1, 1, n, 8)), mx.zeros((1, 1, n, 8)))
        batch.add(row)
    assert batch.padding == [5, 0] and batch.window_of(None) is None
    assert not batch.window_binds(1)  # no window
    assert not batch.window_binds(1, window=9)  # 9 columns: row 1 sees all of them
    assert batch.window_binds(1, window=8)  # row 1's first key left the window
    assert batch.window_of(4) == 4
    rotating = _batch((3,), 0)
    assert rotating.window_of(None) == WINDOW and rotating.window_of(99) == WINDOW


def test_a_prompts_cuts_do_not_change_its_bits() -> None:
    """A sequence reads its prompt in chunks cut where the prefix trie's restore points
    fall, which move with what the trie holds: each query through a sliding window gets
    the same bits however the prompt was cut (chunks of up to 16 go through the kernel
    whether their window binds or not), and the numbers of the full causal mask."""
    n = 40
    q = _new(1, HEADS, n, 9)
    k, v = _new(1, KV_HEADS, n, 10), _new(1, KV_HEADS, n, 11)
    outs = []
    with mx.stream(mx.cpu):
        for cuts in ((16, 16, 8), (8, 8, 8, 8, 8), (5, 11, 16, 8), (2, 14, 3, 13, 8)):
            cache, at, parts = RotatingKVCache(max_size=WINDOW), 0, []
            for m in cuts:
                part = slice(at, at + m)
                parts.append(_attend(cache, q[:, :, part], k[:, :, part], v[:, :, part]))  # type: ignore[arg-type]
                at += m
            outs.append(np.array(mx.concatenate(parts, axis=2)))
        for got in outs[1:]:
            assert np.array_equal(got, outs[0])
        rows = mx.arange(n)[:, None]
        mask = (mx.arange(n)[None, :] <= rows) & (rows - mx.arange(n)[None, :] < WINDOW)
        groups = HEADS // KV_HEADS
        wide_k, wide_v = mx.repeat(k, groups, axis=1), mx.repeat(v, groups, axis=1)
        want = mx.fast.scaled_dot_product_attention(q, wide_k, wide_v, scale=SCALE, mask=mask)
    np.testing.assert_allclose(outs[0], np.array(want), rtol=1e-5, atol=1e-5)
