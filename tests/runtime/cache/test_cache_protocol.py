"""The cache protocol (snapshot, restore, split, merge, free) for each cache type:
data survives paging exactly, and each type refuses what it cannot do."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest

from runtime.cache import (
    Cache,
    KVCache,
    KVSnapshot,
    LayerCache,
    RecurrentCache,
    RecurrentSnapshot,
    RotatingKVCache,
    RotatingSnapshot,
)
from tests.support.recurrent_model import FULL, RECURRENT, SLIDING, HybridModel

# static conformance: mypy checks these assignments against the protocols
_KV: Cache = KVCache()
_ROT: Cache = RotatingKVCache(4)
_REC: LayerCache = RecurrentCache()


def _kv(n: int, start: int = 0) -> tuple[mx.array, mx.array]:
    """Keys/values whose entries encode their position (values = -keys)."""
    k = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 2, 1, 3))
    return k, -k


def _feed(cache: Cache, sizes: Sequence[int], start: int = 0) -> int:
    pos = start
    for size in sizes:
        cache.update_and_fetch(*_kv(size, pos))
        pos += size
    return pos


def _positions(keys: mx.array) -> list[int]:
    return [int(x) for x in np.array(keys)[0, 0, :, 0]]


def _held(cache: KVCache) -> list[int]:
    assert cache.keys is not None
    return _positions(cache.keys[..., : cache.offset, :])


# -- KVCache --


def test_kv_restore_needs_its_base() -> None:
    cache = KVCache(step=4)
    _feed(cache, [10])
    snap = cache.snapshot(5)
    assert snap is not None and (snap.base, snap.end, snap.floor) == (5, 10, 5)
    cache.free()
    assert not cache.restore(snap, 10) and cache.offset == 0
    _feed(cache, [5])
    assert cache.restore(snap, 10) and _held(cache) == list(range(10))


def test_kv_data_survives_snapshot_and_restore() -> None:
    cache = KVCache(step=4)
    _feed(cache, [3, 1, 6])
    snap = cache.snapshot(0)
    assert snap is not None and snap.nbytes == 2 * (2 * 10 * 3 * 4)
    fresh = KVCache(step=4)
    assert fresh.restore(snap, 10) and fresh.offset == 10
    assert _held(fresh) == list(range(10))
    assert fresh.keys is not None and fresh.values is not None
    np.testing.assert_array_equal(
        np.array(fresh.values[..., :10, :]), -np.array(fresh.keys[..., :10, :])
    )
    # stopping short of the end, and decoding on from there
    assert fresh.restore(None, 4) and fresh.restore(snap, 7) and _held(fresh) == list(range(7))
    keys, _ = fresh.update_and_fetch(*_kv(1, 7))
    assert _positions(keys) == list(range(8))


def test_kv_rewind_rules() -> None:
    cache = KVCache()
    _feed(cache, [6])
    assert cache.rewindable and cache.rewind_floor == 0
    assert not cache.restore(None, 7) and cache.offset == 6
    assert cache.restore(None, 2) and cache.offset == 2
    assert cache.snapshot(2) is None  # nothing past the offset to copy


def test_kv_reserve_reads_a_prompt_into_one_buffer() -> None:
    """Room reserved for a prompt: its chunks fill one buffer (no copy of the cache at
    every growth), before the first write or after some, with the tokens held intact."""
    fresh = KVCache(step=4)
    fresh.reserve(10)
    _feed(fresh, [3])
    assert fresh.keys is not None and fresh.keys.shape[2] == 12  # 10, rounded up to the step
    _feed(fresh, [3, 4], start=3)
    assert fresh.keys.shape[2] == 12 and _held(fresh) == list(range(10))
    _feed(fresh, [3], start=10)  # past the room reserved: grows by the step as before
    assert fresh.keys.shape[2] == 16
    assert _held(fresh) == list(range(13))

    held = KVCache(step=4)
    _feed(held, [5])
    held.reserve(20)
    assert held.keys is not None and held.keys.shape[2] == 20 and _held(held) == list(range(5))
    _feed(held, [7, 8], start=5)
    assert held.keys.shape[2] == 20 and _held(held) == list(range(20))


def test_kv_split_then_restore_in_sequence() -> None:
    cache = KVCache(step=4)
    _feed(cache, [10])
    snap = cache.snapshot(0)
    assert snap is not None
    head, tail = cache.split(snap, 5)
    assert snap.closed and snap.close_count == 1
    assert isinstance(head, KVSnapshot) and isinstance(tail, KVSnapshot)
    assert (head.base, head.end, tail.base, tail.end) == (0, 5, 5, 10)
    fresh = KVCache(step=3)
    assert not fresh.restore(tail, 10)  # needs [0, 5) first
    assert fresh.restore(head, 5) and _held(fresh) == list(range(5))
    assert fresh.restore(tail, 10) and _held(fresh) == list(range(10))


def test_kv_split_then_merge_round_trips() -> None:
    cache = KVCache(step=4)
    _feed(cache, [2, 9])
    snap = cache.snapshot(1)
    assert snap is not None
    head, tail = cache.split(snap, 6)
    merged = cache.merge(head, tail)
    assert head is not None and tail is not None and head.closed and tail.closed
    assert isinstance(merged, KVSnapshot) and (merged.base, merged.end) == (1, 11)
    np.testing.assert_array_equal(np.array(merged.keys), np.array(_kv(10, 1)[0]))
    np.testing.assert_array_equal(np.array(merged.values), np.array(_kv(10, 1)[1]))
    # split at or beyond the ends hands the snapshot back whole
    assert cache.split(merged, 1) == (None, merged)
    assert cache.split(merged, 11) == (merged, None)


def test_kv_merge_of_gapped_or_missing_parts_closes_them() -> None:
    cache = KVCache()
    _feed(cache, [8])
    a, b = cache.snapshot(0), cache.snapshot(4)
    assert a is not None and b is not None
    assert cache.merge(a, b) is None and a.closed and b.closed  # [0, 8) + [4, 8) do not join
    c = cache.snapshot(3)
    assert cache.merge(None, c) is None and c is not None and c.closed


def test_closed_snapshot_releases_and_cannot_restore() -> None:
    cache = KVCache()
    _feed(cache, [4])
    snap = cache.snapshot(0)
    assert snap is not None and snap.nbytes > 0
    snap.close()
    assert snap.closed and snap.nbytes == 0
    with pytest.raises(ValueError):
        _ = snap.keys
    assert not KVCache().restore(snap, 4)


def test_snapshots_are_copies_not_views() -> None:
    cache = KVCache(step=16)
    _feed(cache, [4])
    snap = cache.snapshot(0)
    assert cache.restore(None, 2)
    _feed(cache, [2], start=100)  # overwrite positions 2 and 3 in the live buffer
    assert isinstance(snap, KVSnapshot) and _positions(snap.keys) == [0, 1, 2, 3]


# -- RotatingKVCache --


def _window(cache: RotatingKVCache) -> list[int]:
    held = cache._temporal()
    return [] if held is None else _positions(held[0])


def test_rotating_rewinds_live_only_before_the_window_slides() -> None:
    cache = RotatingKVCache(4)
    _feed(cache, [1, 1, 1])
    assert cache.rewind_floor == 0 and cache.restore(None, 1) and _window(cache) == [0]
    cache.free()
    _feed(cache, [1] * 10)
    assert cache.rewind_floor == 9
    assert not cache.restore(None, 3) and cache.offset == 10
    assert not cache.restore(None, 8)
    assert cache.restore(None, 9) and _window(cache) == [6, 7, 8]  # window - 1 is enough


def test_rotating_snapshot_preserves_window() -> None:
    cache = RotatingKVCache(4)
    _feed(cache, [1] * 10)
    snap = cache.snapshot(0)
    assert isinstance(snap, RotatingSnapshot) and (snap.base, snap.end, snap.floor) == (0, 10, 9)
    _feed(cache, [1] * 5, start=10)
    assert cache.restore(snap, 10) and cache.offset == 10
    assert _window(cache) == [6, 7, 8, 9]
    assert not cache.restore(snap, 8)  # would leave too little history


def test_rotating_restore_keeps_write_position() -> None:
    """After a restore the ring continues exactly as a cache that never paged out."""
    cache, reference = RotatingKVCache(4), RotatingKVCache(4)
    _feed(cache, [1] * 6)
    snap = cache.snapshot(0)
    _feed(cache, [1, 1, 1], start=6)
    assert cache.restore(snap, 6)
    pos = _feed(reference, [1] * 6)
    for size in (1, 1, 3, 1, 5, 1):
        mask, want_mask = cache.make_mask(size), reference.make_mask(size)
        got, _ = cache.update_and_fetch(*_kv(size, pos))
        want, _ = reference.update_and_fetch(*_kv(size, pos))
        if size == 1:  # one query sees every held key: ring order is free
            assert sorted(_positions(got)) == sorted(_positions(want))
        else:  # chunks are served oldest first, under the same mask
            assert _positions(got) == _positions(want)
            assert np.array_equal(np.array(mask), np.array(want_mask))
        pos += size
        assert cache.offset == reference.offset == pos


def test_rotating_restore_before_wrap_reaches_any_prefix() -> None:
    cache = RotatingKVCache(8)
    _feed(cache, [5])
    snap = cache.snapshot(0)
    assert snap is not None and snap.floor == 0
    _feed(cache, [6], start=5)
    assert cache.restore(snap, 2) and _window(cache) == [0, 1]
    keys, _ = cache.update_and_fetch(*_kv(1, 2))
    assert sorted(_positions(keys)) == [0, 1, 2]


def test_rotating_split_and_merge() -> None:
    cache = RotatingKVCache(4)
    _feed(cache, [3])
    unwrapped = cache.snapshot(0)
    assert unwrapped is not None
    head, whole = cache.split(unwrapped, 2)
    assert whole is unwrapped and not unwrapped.closed
    assert isinstance(head, RotatingSnapshot) and (head.end, head.held) == (2, 2)
    fresh = RotatingKVCache(4)
    assert fresh.restore(head, 2) and _window(fresh) == [0, 1]
    _feed(cache, [1] * 6, start=3)
    wrapped = cache.snapshot(0)
    assert wrapped is not None
    assert cache.split(wrapped, 5) == (None, wrapped)  # the window at 5 is gone
    assert cache.merge(head, wrapped) is wrapped and head.closed
    assert not RotatingKVCache(5).restore(wrapped, 9)  # another window size


# -- RecurrentCache --


def _recurrent(offset: int) -> RecurrentCache:
    cache = RecurrentCache()
    cache.update(mx.full((1, 2, 3), float(offset)), mx.full((1, 3), float(offset)), offset)
    return cache


def test_recurrent_restores_only_at_the_snapshot_offset() -> None:
    cache = _recurrent(10)
    snap = cache.snapshot(0)
    assert isinstance(snap, RecurrentSnapshot) and (snap.base, snap.floor, snap.end) == (0, 10, 10)
    cache.update(mx.zeros((1, 2, 3)), mx.zeros((1, 3)), 5)
    assert not cache.rewindable and cache.rewind_floor == 15 and cache.trim(3) == 0
    assert not cache.restore(snap, 5) and not cache.restore(snap, 15) and cache.offset == 15
    assert not cache.restore(None, 10) and cache.restore(None, 15)
    assert cache.restore(snap, 10) and cache.offset == 10
    assert cache.conv_state is not None and float(cache.conv_state.sum()) == 60.0
    assert cache.restore(None, 0) and cache.offset == 0 and cache.state == []


def test_recurrent_cannot_split_and_child_supersedes_on_merge() -> None:
    cache = _recurrent(4)
    parent = cache.snapshot(0)
    cache.update(mx.ones((1, 2, 3)), mx.ones((1, 3)), 2)
    child = cache.snapshot(4)
    assert parent is not None and child is not None
    assert cache.split(child, 5) == (None, child) and not child.closed
    assert cache.merge(parent, child) is child and parent.closed and not child.closed


def test_recurrent_layer_state_restores_exactly() -> None:
    """The toy model's logits after a restore equal those of an uninterrupted run."""
    model = HybridModel([FULL, RECURRENT, SLIDING], window=4)
    tokens = mx.array([[5, 3, 9, 1, 4, 4, 2, 8, 7, 6, 1, 0]])
    caches = model.make_caches()
    model.forward(tokens[:, :7], caches)
    snaps = [c.snapshot(0) for c in caches]
    model.forward(tokens[:, 7:10], caches)  # move on, then come back
    for cache, snap in zip(caches, snaps, strict=True):
        assert cache.restore(snap, 7)
    got = model.logits(model.forward(tokens[:, 7:], caches))
    want = model.logits(model.forward(tokens, model.make_caches()))[:, 7:]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    # and restoring nothing into the recurrent layer is caught by the logits
    fresh = model.make_caches()
    model.forward(tokens[:, :7], fresh)
    recurrent = fresh[1]
    assert isinstance(recurrent, RecurrentCache)
    recurrent.free()
    recurrent.update(mx.zeros((1, 2, 64)), mx.zeros((1, 64)), 7)
    wrong = model.logits(model.forward(tokens[:, 7:], fresh))
    assert not np.allclose(np.array(wrong), np.array(want), atol=1e-3)
