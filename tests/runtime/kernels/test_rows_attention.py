"""The primitives over a running batch's rows in buffers of their own (runtime/cache/rows.py):
`append_rows` writes every row's new columns where its buffer is, and `attend_rows` gives
the bits `attend` gives over the same rows left-padded in one buffer (its `starts` at
their padding), on the decode kernel's path and the prompt kernel's (long query blocks,
wide heads), generic and AVX2, and the same for the quantized cache's kernel a row at a
time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime import kernels
from runtime.cache.quantized import quantize


def _rows(
    lengths: Sequence[int], heads: int, dim: int, seed: int, spare: int = 5
) -> tuple[list[mx.array], mx.array, list[int]]:
    """Each row's buffer (1, heads, length + spare, dim; garbage after its length), the
    rows left-padded in one (B, heads, longest, dim) array, and each row's padding."""
    rng = np.random.default_rng(seed)
    longest = max(lengths)
    own, padded = [], np.zeros((len(lengths), heads, longest, dim), np.float32)
    for b, n in enumerate(lengths):
        row = rng.normal(size=(1, heads, n + spare, dim)).astype(np.float32)
        own.append(mx.array(row))
        padded[b, :, longest - n :] = row[0, :, :n]
    return own, mx.array(padded), [longest - n for n in lengths]


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim", "length"),
    [(4, 2, 64, 1), (14, 2, 64, 1), (8, 1, 64, 1), (6, 2, 32, 4), (4, 1, 16, 16), (4, 2, 64, 20),
     (2, 1, 320, 1)],
)  # fmt: skip
@pytest.mark.parametrize(("isa", "threads"), [("", "2"), ("", "7"), ("generic", "3")])
def test_rows_of_their_own_give_the_padded_bits(
    ext: Any, monkeypatch: pytest.MonkeyPatch, q_heads: int, kv_heads: int, dim: int,
    length: int, isa: str, threads: str,
) -> None:  # fmt: skip
    """Thread counts and KV heads change how the decode kernel splits the keys into
    chunks (the longest row's): rows of their own are split the same way."""
    monkeypatch.setenv(kernels.ENV_ISA, isa)
    monkeypatch.setenv(kernels.ENV_THREADS, threads)
    lengths = [700, 20, 300, 33]  # the longest past the decode kernel's chunks
    keys, padded_k, left = _rows(lengths, kv_heads, dim, seed=1)
    values, padded_v, _ = _rows(lengths, kv_heads, dim, seed=2)
    q = mx.array(np.random.default_rng(3).normal(size=(4, q_heads, length, dim)), mx.float32)
    ours = kernels.attend_rows(q, keys, values, lengths, scale=dim**-0.5)
    theirs = kernels.attend(q, padded_k, padded_v, scale=dim**-0.5, causal=True, starts=left)
    assert ours is not None and theirs is not None
    np.testing.assert_array_equal(np.array(ours), np.array(theirs))


def test_append_writes_every_row_where_it_is(ext: Any) -> None:
    """One primitive for all rows and parts: the new columns land at each row's end, the
    rest of every buffer as it was, and no row's buffer is copied."""
    lengths, ends = [3000, 4, 9], [3002, 6, 11]
    keys, _, _ = _rows(lengths, 2, 64, seed=4, spare=40)
    values, _, _ = _rows(lengths, 2, 64, seed=5, spare=40)
    before = [np.array(a) for a in (*keys, *values)]
    rng = np.random.default_rng(6)
    new = [mx.array(rng.normal(size=(3, 2, 2, 64)).astype(np.float32)) for _ in "kv"]
    mx.eval(new)
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    out = kernels.append_rows(new, [keys, values], ends)
    assert out is not None
    mx.eval(out)
    assert mx.get_peak_memory() - start < keys[0].nbytes // 4  # written in place
    for p, part in enumerate(out):
        for b, row in enumerate(part):
            want = before[p * 3 + b].copy()
            want[0, :, ends[b] - 2 : ends[b]] = np.array(new[p][b])
            np.testing.assert_array_equal(np.array(row), want)


def test_a_row_that_is_a_view_is_copied_then_written(ext: Any) -> None:
    held = np.arange(2 * 2 * 8 * 4, dtype=np.float32).reshape(2, 2, 8, 4)
    base = mx.array(held)
    view = base[1:2]  # not its buffer's start: written into a copy
    out = kernels.append_rows([mx.full((1, 2, 1, 4), -1.0)], [[view]], [3])
    assert out is not None
    want = held[1:2].copy()
    want[0, :, 2] = -1.0
    np.testing.assert_array_equal(np.array(out[0][0]), want)
    np.testing.assert_array_equal(np.array(base), held)


def test_a_quantized_cache_a_row_at_a_time_gives_the_padded_bits(ext: Any) -> None:
    if kernels.kernels() is None:
        pytest.skip("the CPU kernels' library is not built")
    lengths = [300, 9, 64]
    rows, padded = [], []
    for b, n in enumerate(lengths):
        rng = np.random.default_rng(10 + b)
        k, v = (mx.array(rng.normal(size=(1, 2, n, 64)).astype(np.float32)) for _ in "kv")
        qk, qv = quantize(k, 8, 64), quantize(v, 8, 64)
        rows.append((qk.arrays, qv.arrays))
        pad = max(lengths) - n
        padded.append(
            [mx.pad(a, [(0, 0), (0, 0), (pad, 0), (0, 0)]) for a in (*qk.arrays, *qv.arrays)]
        )
    kd, ks, kb, vd, vs, vb = (mx.concatenate([p[i] for p in padded], axis=0) for i in range(6))
    q = mx.array(np.random.default_rng(3).normal(size=(3, 4, 1, 64)), mx.float32)
    ours = kernels.quantized_attention_rows(q, rows, lengths, bits=8, group_size=64, scale=0.125)
    theirs = kernels.quantized_attention(
        q, (kd, ks, kb), (vd, vs, vb), bits=8, group_size=64, scale=0.125,
        causal=True, starts=[max(lengths) - n for n in lengths],
    )  # fmt: skip
    assert ours is not None and theirs is not None
    np.testing.assert_array_equal(np.array(ours), np.array(theirs))
