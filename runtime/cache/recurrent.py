"""State of a recurrent layer (hybrid models: short causal conv + linear-attention state).

The state after token n folds in every token before it, so it cannot be rewound or cut:
it is restored only from a snapshot taken at exactly the offset wanted.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import mlx.core as mx

from runtime.cache.protocol import ArraySnapshot, Snapshot, close_all, copy_arrays


class RecurrentSnapshot(ArraySnapshot):
    """The conv tail and recurrent state at offset `end`; self-contained."""

    def __init__(self, conv_state: mx.array, recurrent_state: mx.array, end: int) -> None:
        super().__init__((conv_state, recurrent_state), base=0, end=end, floor=end)

    @property
    def conv_state(self) -> mx.array:
        return self.arrays[0]

    @property
    def recurrent_state(self) -> mx.array:
        return self.arrays[1]


@runtime_checkable
class RecurrentState(Protocol):
    """What a recurrent layer reads and writes: one sequence's cache, or a batch's.

    Both can ask the layer for its states at positions inside a chunk (`cuts`), which it
    hands over on its way (`keep`): restore points a chunk goes past, for the prefix
    trie (`RecurrentCache.capture`) or for a speculative step's rejected tokens
    (runtime/cache/batch_recurrent.py)."""

    conv_state: mx.array | None
    recurrent_state: mx.array | None

    def update(self, conv_state: mx.array, recurrent_state: mx.array, length: int) -> None: ...

    def cuts(self, length: int) -> tuple[int, ...]:
        """The positions 0 < p < length of the next chunk of `length` tokens after which
        the layer hands its states over (`keep`), ascending."""
        ...

    def keep(self, at: int, conv_state: mx.array, recurrent_state: mx.array) -> None:
        """The states after the chunk's first `at` tokens (called before `update`)."""
        ...


class RecurrentCache:
    """The layer reads `conv_state` / `recurrent_state` (None before the first token) and
    calls `update` with the new ones after each chunk."""

    def __init__(self) -> None:
        self.conv_state: mx.array | None = None
        self.recurrent_state: mx.array | None = None
        self._offset = 0
        # offsets inside the next chunk whose states the layer keeps on its way through
        # (`capture`): restore points without cutting a prefill into forwards of its own
        self.wanted: tuple[int, ...] = ()
        self.captured: dict[int, tuple[mx.array, mx.array]] = {}

    @property
    def offset(self) -> int:
        return self._offset

    def update(self, conv_state: mx.array, recurrent_state: mx.array, length: int) -> None:
        """Store the states after `length` more tokens."""
        self.conv_state = conv_state
        self.recurrent_state = recurrent_state
        self._offset += length

    def capture(self, offsets: tuple[int, ...]) -> None:
        """Keep the states at these absolute offsets during the next chunk (the layer
        calls `keep`); what an earlier chunk kept is dropped."""
        self.wanted, self.captured = offsets, {}

    def cuts(self, length: int) -> tuple[int, ...]:
        at = self._offset
        return tuple(sorted({w - at for w in self.wanted if 0 < w - at < length}))

    def keep(self, at: int, conv_state: mx.array, recurrent_state: mx.array) -> None:
        self.captured[self._offset + at] = (conv_state, recurrent_state)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv_state, self.recurrent_state) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state)

    @property
    def rewindable(self) -> bool:
        return False

    @property
    def rewind_floor(self) -> int:
        return self._offset

    def trim(self, n: int) -> int:
        return 0  # folded-in tokens cannot be taken out

    def snapshot(self, from_offset: int, at: int | None = None) -> RecurrentSnapshot | None:
        """The whole state (`from_offset` does not apply: the state is not positional),
        now or, with `at`, as a chunk kept it at that offset (None if it did not)."""
        if at is not None and at != self._offset:
            kept = self.captured.get(at)
            if kept is None:
                return None
            conv, rec = copy_arrays(*kept)
            return RecurrentSnapshot(conv, rec, at)
        if self._offset == 0 or self.conv_state is None or self.recurrent_state is None:
            return None
        conv, rec = copy_arrays(self.conv_state, self.recurrent_state)
        return RecurrentSnapshot(conv, rec, self._offset)

    def restore(self, snapshot: Snapshot | None, target: int) -> bool:
        if target == 0:
            self.free()
            return True
        if snapshot is None:
            return target == self._offset
        if not isinstance(snapshot, RecurrentSnapshot) or snapshot.closed:
            return False
        if target != snapshot.end:
            return False
        # copies, so a layer that writes its state in place cannot reach the snapshot
        self.conv_state, self.recurrent_state = copy_arrays(
            snapshot.conv_state, snapshot.recurrent_state
        )
        self._offset = snapshot.end
        self.wanted, self.captured = (), {}
        return True

    def merge(self, parent: Snapshot | None, child: Snapshot | None) -> Snapshot | None:
        """The child's state already folds in the parent's tokens: it supersedes."""
        close_all(parent)
        return child

    def split(self, snapshot: Snapshot, at: int) -> tuple[Snapshot | None, Snapshot | None]:
        """The state at an earlier offset cannot be recovered."""
        return None, snapshot

    def free(self) -> None:
        self.conv_state = self.recurrent_state = None
        self._offset = 0
        self.wanted, self.captured = (), {}
