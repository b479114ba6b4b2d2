"""The cache protocol: what models and the prefix trie need from a per-layer cache.

Offsets count tokens. A cache at offset n holds what the layer needs to process token n.
A snapshot is paged-out state that brings a cache to `end` tokens; it is a resource that
owns copies of arrays and releases them on `close()`.

Restore rules, which the trie plans with, expressed as numbers so no cache type is sniffed:

- `restore(None, t)` rewinds the live state; it succeeds iff ``t == 0`` (a clean state)
  or ``rewind_floor <= t <= offset``.
- `restore(s, t)` succeeds iff ``t == 0`` or (``s.floor <= t <= s.end`` and, when
  ``s.base > 0``, the cache already holds at least ``s.base`` tokens of the same path:
  a delta snapshot is written on top of them). ``s.base == 0`` means self-contained.
- On success the cache's offset is exactly `t`; on failure the cache is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx

from runtime.cache.mask import Mask


class Snapshot(Protocol):
    """Paged-out state of one layer (see the module docstring for base/floor/end)."""

    @property
    def base(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def floor(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Bytes held (0 once closed)."""
        ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None:
        """Release the arrays; the snapshot cannot be restored afterwards."""
        ...


class LayerCache(Protocol):
    """What the prefix trie needs from every layer's cache, attention or recurrent."""

    @property
    def offset(self) -> int:
        """Tokens seen so far: the position of the next token."""
        ...

    @property
    def state(self) -> list[mx.array]:
        """The arrays to mx.eval after a prefill chunk."""
        ...

    @property
    def nbytes(self) -> int: ...

    @property
    def rewindable(self) -> bool:
        """True when the live state can always rewind to any earlier offset, so the trie
        never needs a snapshot of it while it is live."""
        ...

    @property
    def rewind_floor(self) -> int:
        """The smallest offset `restore(None, t)` can rewind to right now (besides 0)."""
        ...

    def snapshot(self, from_offset: int) -> Snapshot | None:
        """Copy what it takes to bring a cache holding `from_offset` tokens to `offset`.

        Self-contained caches ignore `from_offset` and copy their whole state. None when
        there is nothing to copy. The live cache is unchanged.
        """
        ...

    def restore(self, snapshot: Snapshot | None, target: int) -> bool:
        """Bring the cache to exactly `target` tokens (rules in the module docstring)."""
        ...

    def merge(self, parent: Snapshot | None, child: Snapshot | None) -> Snapshot | None:
        """Join consecutive snapshots [a, b) + [b, c) into one for [a, c).

        Takes ownership of both (each is returned or closed); None when they cannot join.
        """
        ...

    def split(self, snapshot: Snapshot, at: int) -> tuple[Snapshot | None, Snapshot | None]:
        """Divide a snapshot at offset `at` into (restores to `at`, restores to its end).

        Takes ownership of `snapshot`. A part that cannot be recovered is None.
        """
        ...

    def free(self) -> None:
        """Drop all state: offset 0, arrays released."""
        ...

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens where possible; return how many were dropped."""
        ...


class Cache(LayerCache, Protocol):
    """An attention layer's cache (the protocol's `update` is `update_and_fetch`)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add (B, n_kv_heads, L, head_dim) keys/values; return the ones to attend to."""
        ...

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        """The attention mask for the next update of `length` tokens (call before it)."""
        ...


class ArraySnapshot:
    """A snapshot that owns copies of some arrays; each cache type subclasses it.

    `close_count` is kept so tests can prove every snapshot is closed exactly once.
    """

    def __init__(self, arrays: Sequence[mx.array], *, base: int, end: int, floor: int) -> None:
        self._arrays: tuple[mx.array, ...] | None = tuple(arrays)
        self.base = base
        self.end = end
        self.floor = floor
        self._nbytes = sum(int(a.nbytes) for a in arrays)
        self.close_count = 0
        # where the same state also lives (the prefix cache's disk tier sets it on what it
        # reads back), so paging this snapshot out again needs no second write
        self.source: Snapshot | None = None

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        if self._arrays is None:
            raise ValueError("snapshot is closed")
        return self._arrays

    @property
    def nbytes(self) -> int:
        return 0 if self._arrays is None else self._nbytes

    @property
    def closed(self) -> bool:
        return self._arrays is None

    def close(self) -> None:
        self.close_count += 1
        self._arrays = None
        self.source = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._nbytes}B"
        return (
            f"{type(self).__name__}(base={self.base}, end={self.end}, floor={self.floor}, {state})"
        )


def copy_arrays(*arrays: mx.array) -> list[mx.array]:
    """Fresh copies, queued for evaluation.

    A copy (not a view) so a snapshot neither pins the live buffer nor blocks MLX from
    updating that buffer in place; async_eval so the copy does not hold the graph.
    """
    copies = [mx.array(a) for a in arrays]
    mx.async_eval(*copies)
    return copies


def close_all(*snapshots: Snapshot | None) -> None:
    for snap in snapshots:
        if snap is not None:
            snap.close()
