"""A key/value cache for sliding-window layers that holds at most `max_size` tokens.

A query sees itself and the `max_size - 1` tokens before it (transformers' sliding window).
Layout invariant: while fewer than `max_size` tokens are held, they sit in temporal order
at the start of the buffer; once exactly `max_size` are held the buffer is a ring whose
oldest entry is at `_idx`, so single-token decode overwrites one slot instead of shifting.
A multi-token chunk is served from the previous `max_size - 1` tokens (in order) plus the
chunk, then the last `max_size` of those are kept, in order.

Paging: a snapshot is the held window, oldest first, plus the offset; it restores on its
own (base 0). Live rewinding, and stopping a restore short of the snapshot's end, are
possible while nothing has slid out of the window, and afterwards only as far as leaves
the `max_size - 1` tokens the next query needs.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.cache.mask import Mask, window_mask
from runtime.cache.protocol import ArraySnapshot, Snapshot, close_all, copy_arrays


def _rewind_floor(offset: int, held: int, max_size: int) -> int:
    """The smallest offset reachable by dropping newest tokens from a window of `held`."""
    if held == offset:
        return 0  # nothing has slid out: any prefix is still there
    return offset - held + max_size - 1


class RotatingSnapshot(ArraySnapshot):
    """The window held at offset `end`, oldest first; self-contained."""

    def __init__(self, keys: mx.array, values: mx.array, end: int, max_size: int) -> None:
        held = keys.shape[2]
        floor = _rewind_floor(end, held, max_size)
        super().__init__((keys, values), base=0, end=end, floor=floor)
        self.max_size = max_size
        self.held = held

    @property
    def keys(self) -> mx.array:
        return self.arrays[0]

    @property
    def values(self) -> mx.array:
        return self.arrays[1]


class RotatingKVCache:
    def __init__(self, max_size: int, step: int = 256) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self.max_size = max_size
        self.step = step
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._offset = 0  # tokens seen
        self._size = 0  # tokens held, <= max_size
        self._idx = 0  # ring position of the oldest token, when _size == max_size

    @property
    def offset(self) -> int:
        """Tokens seen so far (held or already slid out); the position of the next token."""
        return self._offset

    def _temporal(self) -> tuple[mx.array, mx.array] | None:
        """The held keys and values, oldest first."""
        if self.keys is None or self.values is None or self._size == 0:
            return None
        k, v = self.keys[..., : self._size, :], self.values[..., : self._size, :]
        if self._size == self.max_size and self._idx > 0:
            i = self._idx
            k = mx.concatenate([k[..., i:, :], k[..., :i, :]], axis=2)
            v = mx.concatenate([v[..., i:, :], v[..., :i, :]], axis=2)
        return k, v

    def _append_one(self, keys: mx.array, values: mx.array) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if self._size >= capacity:
            needed = self._size + 1
            new_cap = min(self.max_size, ((needed + self.step - 1) // self.step) * self.step)
            batch, heads, _, k_dim = keys.shape
            new_k = mx.zeros((batch, heads, new_cap, k_dim), dtype=keys.dtype)
            new_v = mx.zeros((batch, heads, new_cap, values.shape[-1]), dtype=values.dtype)
            if self.keys is not None and self.values is not None and self._size > 0:
                new_k[..., : self._size, :] = self.keys[..., : self._size, :]
                new_v[..., : self._size, :] = self.values[..., : self._size, :]
            self.keys, self.values = new_k, new_v
        assert self.keys is not None and self.values is not None
        self.keys[..., self._size : self._size + 1, :] = keys
        self.values[..., self._size : self._size + 1, :] = values
        self._size += 1
        self._idx = 0

    def _update_one(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._size < self.max_size:
            self._append_one(keys, values)
        else:
            assert self.keys is not None and self.values is not None
            i = self._idx
            self.keys[..., i : i + 1, :] = keys
            self.values[..., i : i + 1, :] = values
            self._idx = (i + 1) % self.max_size
        self._offset += 1
        # oldest first, as a chunk's update and a batch hand them over: one query sees
        # every held key, but the order its sums take them in sets its bits
        held = self._temporal()
        assert held is not None
        return held

    def _update_chunk(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        held = self._temporal()
        keep = min(self._size, self.max_size - 1)
        if held is not None and keep > 0:
            k = mx.concatenate([held[0][..., self._size - keep :, :], keys], axis=2)
            v = mx.concatenate([held[1][..., self._size - keep :, :], values], axis=2)
        else:
            k, v = keys, values
        total = k.shape[2]
        start = max(0, total - self.max_size)
        if start > 0:
            # copy, so a long chunk's keys are not kept alive behind a view of the window
            self.keys = mx.contiguous(k[..., start:, :])
            self.values = mx.contiguous(v[..., start:, :])
        else:
            self.keys, self.values = k, v
        self._size = total - start
        self._idx = 0
        self._offset += keys.shape[2]
        return k, v

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add (B, n_kv_heads, L, head_dim) keys/values; return those the new queries may see.

        The returned keys are in temporal order (the previous window, then the new ones)
        and `make_mask(L)` matches them.
        """
        if keys.shape[2] == 1:
            return self._update_one(keys, values)
        return self._update_chunk(keys, values)

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        """The mask for the next `update_and_fetch` of `length` tokens.

        The window is this cache's `max_size`; `window` is accepted for interface parity.
        """
        if length == 1:
            return None  # every held key is within the window of the newest token
        keep = min(self._size, self.max_size - 1)
        if keep + length <= self.max_size:
            return "causal"  # the window cannot bind inside this chunk
        return window_mask(length, keep + length, self.max_size)

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate after a prefill chunk."""
        if self.keys is None or self.values is None:
            return []
        return [self.keys, self.values]

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens, all or nothing; return how many were dropped.

        Possible while nothing has slid out of the window, or (after it has) when at
        least `max_size - 1` tokens stay, the history the next query needs.
        """
        n = max(0, min(n, self._offset))
        if n == 0:
            return 0
        nothing_dropped = self._offset == self._size
        if not nothing_dropped and self._size - n < self.max_size - 1:
            return 0
        held = self._temporal()
        if held is not None:
            self.keys = held[0][..., : self._size - n, :]
            self.values = held[1][..., : self._size - n, :]
        self._size -= n
        self._idx = 0
        self._offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers."""
        if self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)

    # -- paging (runtime/cache/protocol.py) --

    @property
    def rewindable(self) -> bool:
        return False

    @property
    def rewind_floor(self) -> int:
        return _rewind_floor(self._offset, self._size, self.max_size)

    def _usable(self, snap: Snapshot | None) -> RotatingSnapshot | None:
        if (
            isinstance(snap, RotatingSnapshot)
            and not snap.closed
            and snap.max_size == self.max_size
        ):
            return snap
        return None

    def snapshot(self, from_offset: int) -> RotatingSnapshot | None:
        held = self._temporal()
        if held is None or self._offset <= from_offset:
            return None
        keys, values = copy_arrays(*held)
        return RotatingSnapshot(keys, values, self._offset, self.max_size)

    def restore(self, snapshot: Snapshot | None, target: int) -> bool:
        if target == 0:
            self.free()
            return True
        if snapshot is None:
            if not self.rewind_floor <= target <= self._offset:
                return False
            self.trim(self._offset - target)
            return True
        snap = self._usable(snapshot)
        if snap is None or not snap.floor <= target <= snap.end:
            return False
        # copies: the live buffer is written in place, the snapshot must stay intact
        self.keys, self.values = copy_arrays(snap.keys, snap.values)
        self._size, self._idx, self._offset = snap.held, 0, snap.end
        self.trim(snap.end - target)
        return True

    def merge(self, parent: Snapshot | None, child: Snapshot | None) -> Snapshot | None:
        """The child's window supersedes the parent's."""
        close_all(parent)
        return child

    def split(self, snapshot: Snapshot, at: int) -> tuple[Snapshot | None, Snapshot | None]:
        """The part up to `at` exists only if the window can be cut back to `at`."""
        snap = self._usable(snapshot)
        if snap is None or not snap.floor <= at < snap.end:
            return None, snapshot
        keep = snap.held - (snap.end - at)
        keys, values = copy_arrays(snap.keys[..., :keep, :], snap.values[..., :keep, :])
        return RotatingSnapshot(keys, values, at, self.max_size), snapshot

    def free(self) -> None:
        self.keys = self.values = None
        self._offset = self._size = self._idx = 0
