"""The quantized KV cache (runtime/cache/quantized.py) against its oracle, `mx.quantize` of
what a float `KVCache` holds: the same bits whatever the chunking, through every step of
the cache protocol (snapshot, restore, split, merge, free, trim), the batch's rows, and
the disk tier's codec; and its bytes are what its arrays take."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest

from runtime.cache import (
    BatchCaches,
    BatchQuantizedCache,
    Cache,
    KVCache,
    LatentCache,
    Quantized,
    QuantizedKVCache,
    QuantizedSnapshot,
    RecurrentCache,
    RotatingKVCache,
    quantizing,
    rotate,
)
from runtime.cache.codec import KV_QUANTIZED, decode, encode, layout_of
from runtime.cache.quantized import group_size_for, padded_dim

# static conformance: mypy checks this against the protocol
_Q: Cache = QuantizedKVCache()

HEADS, DIM = 2, 64


def _tokens(n: int, seed: int) -> tuple[mx.array, mx.array]:
    """Random keys and values of n tokens (values on another scale than keys)."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(1, HEADS, n, DIM)).astype(np.float32) * 3
    v = rng.normal(size=(1, HEADS, n, DIM)).astype(np.float32)
    return mx.array(k), mx.array(v)


def _feed(caches: Sequence[KVCache | QuantizedKVCache], sizes: Sequence[int], seed: int) -> None:
    for i, size in enumerate(sizes):
        k, v = _tokens(size, seed + i)
        for cache in caches:
            cache.update_and_fetch(k, v)


def _hadamard(n: int) -> mx.array:
    """The normalized Sylvester-Hadamard matrix of order n (a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return mx.array((h / np.sqrt(n)).astype(np.float32))


def test_keys_are_rotated_by_the_hadamard_matrix_in_blocks() -> None:
    rng = np.random.default_rng(0)
    for width, block in ((32, 32), (64, 64), (96, 32), (128, 128)):
        x = mx.array(rng.normal(size=(2, 3, 4, width)).astype(np.float32))
        matrix = mx.array(np.kron(np.eye(width // block), np.array(_hadamard(block))))
        np.testing.assert_allclose(np.array(rotate(x)), np.array(x @ matrix), atol=1e-5)
        np.testing.assert_allclose(np.array(rotate(rotate(x))), np.array(x), atol=1e-5)
        # each vector on its own: a chunk rotates as its tokens do one at a time
        ones = mx.concatenate([rotate(x[:, :, i : i + 1]) for i in range(4)], axis=2)
        assert mx.array_equal(ones, rotate(x)).item()


def _expected(kv: KVCache, bits: int, group: int) -> list[np.ndarray]:
    """mx.quantize of the float cache's keys (at 8 bits rotated by the Hadamard matrix)
    and values: the six arrays it should hold."""
    assert kv.keys is not None and kv.values is not None
    n = kv.offset
    keys, values = kv.keys[..., :n, :], kv.values[..., :n, :]
    if bits == 8:
        keys = mx.hadamard_transform(keys, scale=DIM**-0.5)
    out = []
    for x in (keys, values):
        out += [np.array(a) for a in mx.quantize(x, group_size=group, bits=bits)]
    return out


def _held(cache: QuantizedKVCache) -> list[np.ndarray]:
    held = cache.held()
    assert held is not None
    return [np.array(a) for q in held for a in q.arrays]


def _same(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> None:
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [64, 32])
def test_it_holds_quantize_of_the_float_cache_whatever_the_chunks(bits: int, group: int) -> None:
    kv, q = KVCache(step=4), QuantizedKVCache(bits, group, step=4)
    _feed([kv, q], [5, 1, 1, 9, 3], seed=1)
    assert q.offset == kv.offset == 19
    _same(_held(q), _expected(kv, bits, group))
    held = q.held()
    assert held is not None
    keys, values = held
    assert (keys.bits, keys.group_size, values.tokens) == (bits, group, 19)
    # what update_and_fetch returns is what the quantized attention reads, dequantized
    k, v = _tokens(2, 99)
    kv.update_and_fetch(k, v)
    got_k, got_v = q.update_and_fetch(k, v)
    want = _expected(kv, bits, group)
    for got, (w, s, b), turn in ((got_k, want[:3], True), (got_v, want[3:], False)):
        again = mx.dequantize(mx.array(w), mx.array(s), mx.array(b), group_size=group, bits=bits)
        if turn and bits == 8:  # keys come back rotated back
            again = mx.hadamard_transform(again, scale=DIM**-0.5)
        np.testing.assert_array_equal(np.array(got), np.array(again))
    # 8 bits are close to the floats, 4 bits further off
    assert kv.keys is not None
    # (a group's range over 2^bits - 1 steps, rounded: an error of about a twelfth's root
    # of a step, for normal values spanning about 6 sigma)
    want_k = kv.keys[..., :21, :]
    rel = float(mx.sqrt(mx.sum((got_k - want_k) ** 2) / mx.sum(want_k**2)))
    assert rel <= 1.5 * 6 / (2**bits - 1) / 12**0.5


def test_a_head_dim_is_padded_to_a_multiple_of_32_and_grouped_in_what_divides_it() -> None:
    assert [padded_dim(d) for d in (16, 64, 80, 112)] == [32, 64, 96, 128]
    assert group_size_for(64, 64) == 64 and group_size_for(96, 64) == 32
    assert group_size_for(128, 32) == 32
    cache = QuantizedKVCache(8)
    k = mx.ones((1, 1, 3, 96))
    keys, _ = cache.update_quantized(k, k)
    assert keys.group_size == 32 and keys.scales.shape == (1, 1, 3, 3) and keys.width == 96
    # 80 is held as 96 (zeros after it); what the layer gets back has its own 80
    rng = np.random.default_rng(4)
    x = mx.array(rng.normal(size=(1, 2, 5, 80)).astype(np.float32))
    padded = QuantizedKVCache(8)
    got, _ = padded.update_and_fetch(x, x)
    held = padded.held()
    assert held is not None and held[0].width == 96 and got.shape == (1, 2, 5, 80)
    wide = mx.concatenate([x, mx.zeros((1, 2, 5, 16))], axis=-1)
    blocks = mx.array(np.kron(np.eye(3), np.array(_hadamard(32))))  # 96 = 3 x 32
    want = mx.dequantize(*mx.quantize(wide @ blocks, group_size=32, bits=8), group_size=32, bits=8)
    np.testing.assert_allclose(np.array(got), np.array(want @ blocks)[..., :80], atol=1e-5)


def test_snapshot_restore_and_rewind_keep_the_bits() -> None:
    kv, q = KVCache(step=4), QuantizedKVCache(8, step=4)
    _feed([kv, q], [6, 4], seed=3)
    want = _expected(kv, 8, 64)
    snap = q.snapshot(4)
    assert isinstance(snap, QuantizedSnapshot) and (snap.base, snap.end, snap.floor) == (4, 10, 4)
    assert snap.nbytes == sum(a[..., 4:, :].nbytes for a in want)
    fresh = QuantizedKVCache(8, step=3)
    assert not fresh.restore(snap, 10) and fresh.offset == 0  # needs [0, 4) first
    whole = q.snapshot(0)
    assert whole is not None and fresh.restore(whole, 4) and fresh.offset == 4
    assert fresh.restore(snap, 10)
    _same(_held(fresh), want)
    # rewinding, and stopping short of a snapshot's end
    assert q.rewindable and q.rewind_floor == 0
    assert not q.restore(None, 11) and q.offset == 10
    assert q.restore(None, 3) and q.offset == 3
    assert q.restore(whole, 7)
    _same(_held(q), [a[..., :7, :] for a in want])
    # another width cannot restore it
    assert not QuantizedKVCache(4).restore(whole, 10)
    assert not KVCache().restore(whole, 10)


def test_split_and_merge_round_trip() -> None:
    kv, q = KVCache(), QuantizedKVCache(4, 32)
    _feed([kv, q], [11], seed=5)
    want = _expected(kv, 4, 32)
    snap = q.snapshot(1)
    assert snap is not None
    head, tail = q.split(snap, 6)
    assert (
        snap.closed and isinstance(head, QuantizedSnapshot) and isinstance(tail, QuantizedSnapshot)
    )
    assert (head.base, head.end, tail.base, tail.end) == (1, 6, 6, 11)
    merged = q.merge(head, tail)
    assert head.closed and tail.closed and isinstance(merged, QuantizedSnapshot)
    assert (merged.base, merged.end) == (1, 11)
    _same([np.array(a) for a in merged.arrays], [a[..., 1:, :] for a in want])
    assert q.split(merged, 1) == (None, merged) and q.split(merged, 11) == (merged, None)
    gap = q.snapshot(8)
    assert q.merge(q.snapshot(0), gap) is None and gap is not None and gap.closed


def test_trim_free_reserve_and_bytes() -> None:
    q = QuantizedKVCache(8, step=4)
    q.reserve(10)
    _feed([q], [3], seed=7)
    keys = q.keys
    assert keys is not None and keys.data.shape[2] == 12  # room for the prompt, in steps
    _feed([q], [7], seed=8)
    keys = q.keys
    assert keys is not None and keys.data.shape[2] == 12
    # the real bytes: codes at 8 bits and a float32 scale and bias per 64 values
    per_token = 2 * HEADS * (DIM + 2 * 4)
    assert q.nbytes == 12 * per_token
    assert q.trim(4) == 4 and q.offset == 6 and q.nbytes == 12 * per_token
    q.free()
    assert q.offset == 0 and q.nbytes == 0 and q.held() is None and q.snapshot(0) is None


def test_quantizing_replaces_only_full_attention_kv_caches() -> None:
    def make() -> list[object]:
        return [KVCache(), RotatingKVCache(4), RecurrentCache(), LatentCache()]

    made = quantizing(make, 4)()
    assert [type(c) for c in made] == [
        QuantizedKVCache,
        RotatingKVCache,
        RecurrentCache,
        LatentCache,
    ]
    assert isinstance(made[0], QuantizedKVCache) and made[0].bits == 4
    assert [type(c) for c in quantizing(make, None)()] == [type(c) for c in make()]
    with pytest.raises(ValueError):
        quantizing(make, 3)
    with pytest.raises(ValueError):
        QuantizedKVCache(2)


# -- the batch's rows --


def test_batch_rows_equal_each_row_alone() -> None:
    """Rows of different lengths join (left padding), decode together, and leave: each
    ends holding exactly what it holds decoding alone."""
    alone = [QuantizedKVCache(8, step=4) for _ in range(3)]
    rows = [QuantizedKVCache(8, step=4) for _ in range(3)]
    for i, size in enumerate((5, 9, 2)):
        _feed([alone[i], rows[i]], [size], seed=10 + i)
    batch = BatchCaches([rows[0]])
    for row in rows:
        batch.add([row])
    layer = batch.layers[0]
    assert isinstance(layer, BatchQuantizedCache) and layer.rows == 3
    assert layer.padding == [4, 0, 7]
    views = batch.views(1)
    assert views is not None and isinstance(views[0][0], Quantized)
    for step in range(3):
        k, v = _tokens(3, 50 + step)  # one new token per row
        keys, values = layer.update_quantized(k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3))
        assert keys.tokens == values.tokens == 9 + step + 1
        for i in range(3):
            alone[i].update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert np.array(layer.offset).tolist() == [8, 12, 5]
    per_token, fixed = batch.bytes_per_token()
    assert per_token == 2 * HEADS * (DIM + 2 * 4) and fixed == 0
    # leave in any order: (index in the batch now, row); the last takes the buffers
    for index, original in ((2, 2), (0, 0), (0, 1)):
        out = batch.row(index)
        batch.remove([index])
        assert isinstance(out[0], QuantizedKVCache)
        _same(_held(out[0]), _held(alone[original]))
    assert batch.rows == 0


def test_the_codec_round_trips_and_refuses_what_does_not_fit() -> None:
    q = QuantizedKVCache(4, 64)
    _feed([q], [9], seed=20)
    layout = layout_of(q)
    assert layout is not None and layout.kind == KV_QUANTIZED
    assert dict(layout.params) == {"bits": 4, "group_size": 64, "key_rotation": 0}
    assert layout_of(QuantizedKVCache(8)).params["key_rotation"] == 1  # type: ignore[union-attr]
    assert layout != layout_of(QuantizedKVCache(8)) and layout != layout_of(KVCache())
    snap = q.snapshot(3)
    assert snap is not None
    enc = encode(snap)
    assert enc is not None and enc.layout == layout and len(enc.arrays) == 6
    back = decode(enc.layout, enc.base, enc.floor, enc.end, enc.arrays)
    assert isinstance(back, QuantizedSnapshot) and (back.base, back.end) == (3, 9)
    fresh = QuantizedKVCache(4, 64)
    whole = q.snapshot(0)
    assert whole is not None and fresh.restore(whole, 3) and fresh.restore(back, 9)
    _same(_held(fresh), _held(q))
    # another width's layout differs (above: the disk tier refuses it on that); groups
    # that are not the layout's are refused when decoding
    with pytest.raises(ValueError, match="groups"):
        decode(layout_of(QuantizedKVCache(4, 32)), 3, 3, 9, enc.arrays)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        decode(enc.layout, 2, 2, 9, enc.arrays)
    with pytest.raises(ValueError):
        decode(enc.layout, 3, 3, 9, enc.arrays[:5])
