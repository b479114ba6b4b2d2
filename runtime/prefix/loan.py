"""The live path's state lent to a batch row, so that a long prompt is not held twice.

When a sequence's prompt is in, the trie records it on the live path (the next request
sharing it reuses it) and the sequence joins the running batch with the same keys and
values. Where every layer is a full-attention KV cache, the live caches let go of
their buffers instead of keeping a second copy: the batch's first row takes them over
and writes its new tokens in place (runtime/cache/batch.py). The trie keeps a `Loan`,
the path's length and where to find the state (the row's keys and values, the first
`end` positions of which are the path's), and takes it back, a copy of those positions,
only when it next needs the live state: the next request's `begin`, a finished row's
`adopt` (whose own buffers are simply handed over when they extend the live path), or
`close` with a disk tier; an abort takes it back before the batch goes. A loan whose row
is gone, or whose arrays cannot be read (a worker died mid-step), takes back nothing:
the live path is then dropped, as after an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from runtime.cache import KVCache, KVSnapshot

# per layer, a row's keys and values from its first position (views, not copies)
RowState = Sequence[tuple[mx.array, mx.array]]


@dataclass(frozen=True)
class Loan:
    source: Callable[[], RowState | None]
    end: int  # the live path's length: the positions taken back


def lendable(caches: Sequence[object]) -> bool:
    """Whether every live cache is a plain KV cache (a window or a recurrent state
    could not be taken back from a row that has decoded on)."""
    return bool(caches) and all(type(c) is KVCache for c in caches)


def take_back(loan: Loan, caches: Sequence[KVCache]) -> bool:
    """Copy the loan's positions from the row into the (empty) live caches."""
    rows = loan.source()
    if rows is None or len(rows) != len(caches):
        return False
    for live, (keys, values) in zip(caches, rows, strict=True):
        if keys.shape[2] < loan.end:
            return False
        snap = KVSnapshot(keys[..., : loan.end, :], values[..., : loan.end, :], 0, loan.end)
        if not live.restore(snap, loan.end):
            return False
    mx.eval([a for c in caches for a in c.state])
    return True


def hand_over(caches: Sequence[KVCache], own: Sequence[object], length: int) -> bool:
    """The live caches take `own`'s buffers (a finished row holding `length` tokens that
    extend the live path): no copy. False, and nothing changed, unless every one is a
    plain KV cache at `length`."""
    if len(own) != len(caches) or not all(
        type(c) is KVCache and c.offset == length and c.keys is not None for c in own
    ):
        return False
    for live, row in zip(caches, own, strict=True):
        assert isinstance(row, KVCache) and row.keys is not None and row.values is not None
        live.hold(row.keys, row.values, length)
        row.free()
    # computed here, on the thread that owns the row's stream (a disk tier may read
    # the live state from another one when the engine closes)
    mx.eval([a for c in caches for a in c.state])
    return True
