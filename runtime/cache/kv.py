"""A growing key/value cache for full-attention layers, with its snapshots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import mlx.core as mx

from runtime.cache.mask import Mask, window_mask
from runtime.cache.protocol import ArraySnapshot, Snapshot, close_all, copy_arrays


class KVSnapshot(ArraySnapshot):
    """Keys and values of positions [base, end): a delta written on top of [0, base)."""

    def __init__(self, keys: mx.array, values: mx.array, base: int, end: int) -> None:
        super().__init__((keys, values), base=base, end=end, floor=base)

    @property
    def keys(self) -> mx.array:
        return self.arrays[0]

    @property
    def values(self) -> mx.array:
        return self.arrays[1]


def _usable(snap: Snapshot | None) -> KVSnapshot | None:
    return snap if isinstance(snap, KVSnapshot) and not snap.closed else None


class KVCache:
    """Keys and values of every token seen, in a buffer that grows `step` tokens at a time.

    Writing into a preallocated buffer by slice assignment keeps single-token decode from
    copying the whole cache each step, as concatenation would. It can rewind to any offset.
    """

    def __init__(self, step: int = 256) -> None:
        self.step = step
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._offset = 0
        self._reserved = 0  # tokens the next growth makes room for at least (`reserve`)

    @property
    def offset(self) -> int:
        """Tokens seen (and held) so far; the position of the next token."""
        return self._offset

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` tokens in all (a prompt about to be read): a long prompt
        read in chunks then fills one buffer, where growing `step` tokens a time would
        copy the whole cache at every chunk (at 16k tokens, 12 ms a layer a chunk)."""
        self._reserved = max(self._reserved, tokens)
        if self.keys is not None and self.values is not None and tokens > self.keys.shape[2]:
            self._grow(self.keys, self.values, tokens)

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        needed = max(needed, self._reserved)
        capacity = ((needed + self.step - 1) // self.step) * self.step
        batch, heads, _, k_dim = keys.shape
        new_k = mx.zeros((batch, heads, capacity, k_dim), dtype=keys.dtype)
        new_v = mx.zeros((batch, heads, capacity, values.shape[-1]), dtype=values.dtype)
        if self.keys is not None and self.values is not None and self._offset > 0:
            new_k[..., : self._offset, :] = self.keys[..., : self._offset, :]
            new_v[..., : self._offset, :] = self.values[..., : self._offset, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (B, n_kv_heads, L, head_dim) keys/values; return all held so far."""
        start = self._offset
        end = start + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        assert self.keys is not None and self.values is not None
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self._offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        """The mask for the next `update_and_fetch` of `length` tokens.

        `window` limits how far back a query looks (a sliding-window layer served by a cache
        that keeps everything); without it the mask is plain causal.
        """
        total = self._offset + length
        if window is None or total <= window:
            return None if length == 1 else "causal"
        return window_mask(length, total, window)

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate after a prefill chunk (the whole buffers)."""
        if self.keys is None or self.values is None:
            return []
        return [self.keys, self.values]

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (at most all of them); return how many were dropped."""
        n = max(0, min(n, self._offset))
        self._offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers (capacity, not just the tokens held)."""
        if self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)

    # -- paging (runtime/cache/protocol.py) --

    @property
    def rewindable(self) -> bool:
        return True

    @property
    def rewind_floor(self) -> int:
        return 0

    def snapshot(self, from_offset: int) -> KVSnapshot | None:
        start = max(0, from_offset)
        if self.keys is None or self.values is None or start >= self._offset:
            return None
        keys, values = copy_arrays(
            self.keys[..., start : self._offset, :], self.values[..., start : self._offset, :]
        )
        return KVSnapshot(keys, values, start, self._offset)

    def restore(self, snapshot: Snapshot | None, target: int) -> bool:
        if snapshot is None or target == 0:
            if not 0 <= target <= self._offset:
                return False
            self._offset = target
            return True
        snap = _usable(snapshot)
        if snap is None or not snap.base <= target <= snap.end or snap.base > self._offset:
            return False
        self._offset = snap.base
        count = target - snap.base
        if count > 0:
            self.update_and_fetch(snap.keys[..., :count, :], snap.values[..., :count, :])
        return True

    def merge(self, parent: Snapshot | None, child: Snapshot | None) -> Snapshot | None:
        first, second = _usable(parent), _usable(child)
        merged = None
        if first is not None and second is not None and first.end == second.base:
            keys = mx.concatenate([first.keys, second.keys], axis=2)
            values = mx.concatenate([first.values, second.values], axis=2)
            mx.async_eval(keys, values)
            merged = KVSnapshot(keys, values, first.base, second.end)
        close_all(parent, child)
        return merged

    def split(self, snapshot: Snapshot, at: int) -> tuple[Snapshot | None, Snapshot | None]:
        snap = _usable(snapshot)
        if snap is None or at <= snap.base:
            return None, snapshot
        if at >= snap.end:
            return snapshot, None
        n = at - snap.base
        k_head, v_head, k_tail, v_tail = copy_arrays(
            snap.keys[..., :n, :],
            snap.values[..., :n, :],
            snap.keys[..., n:, :],
            snap.values[..., n:, :],
        )
        snapshot.close()
        return KVSnapshot(k_head, v_head, snap.base, at), KVSnapshot(k_tail, v_tail, at, snap.end)

    def free(self) -> None:
        self.keys = self.values = None
        self._offset = 0

    def hold(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Take these buffers as its own, without a copy: their first `offset` positions
        are the tokens seen, the columns after them room to grow (a batch's buffers
        handed back when its last row leaves, runtime/cache/batch.py)."""
        if not 0 <= offset <= min(keys.shape[2], values.shape[2]):
            raise ValueError(f"offset {offset} outside buffers of {keys.shape[2]} columns")
        self.keys, self.values, self._offset = keys, values, offset


@runtime_checkable
class Reserving(Protocol):
    """A cache that can make room for a whole prompt at once (KV caches, plain or
    quantized)."""

    def reserve(self, tokens: int) -> None: ...


def reserve_prompt(caches: Sequence[object], tokens: int) -> None:
    """Every KV layer among `caches` makes room for a prompt of `tokens` tokens in all,
    before its first chunk is read (`KVCache.reserve`)."""
    for c in caches:
        if isinstance(c, Reserving):
            c.reserve(tokens)
