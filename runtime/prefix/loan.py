"""The live path's state lent to a batch row, so that a long prompt is not held twice.

When a sequence's prompt is in, the trie records it on the live path (the next request
sharing it reuses it) and the sequence joins the running batch with the same keys and
values. Where every layer is a full-attention KV cache (all plain, or all quantized:
runtime/cache/quantized.py), the live caches let go of
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

from runtime.cache import (
    KVCache,
    KVSnapshot,
    Quantized,
    QuantizedKVCache,
    QuantizedSnapshot,
    RowView,
    Snapshot,
)

# per layer, a row's keys and values from its first position (views, not copies)
RowState = Sequence[RowView]
LiveCache = KVCache | QuantizedKVCache


@dataclass(frozen=True)
class Loan:
    source: Callable[[], RowState | None]
    end: int  # the live path's length: the positions taken back


def lendable(caches: Sequence[object]) -> bool:
    """Whether every live cache is a plain KV cache, or every one a quantized KV cache
    (a window or a recurrent state could not be taken back from a row that has decoded
    on)."""
    kinds = (KVCache, QuantizedKVCache)
    return bool(caches) and any(all(type(c) is kind for c in caches) for kind in kinds)


def _head(
    live: LiveCache, keys: mx.array | Quantized, values: mx.array | Quantized, end: int
) -> Snapshot | None:
    """The first `end` positions of a row's keys and values, as a snapshot of [0, end)
    for `live` (views: the restore copies them); None when the row holds fewer."""
    if isinstance(keys, Quantized) and isinstance(values, Quantized):
        if keys.tokens < end or not isinstance(live, QuantizedKVCache):
            return None
        head_k, head_v = keys.span(0, end), values.span(0, end)
        return QuantizedSnapshot.of(head_k, head_v, 0, end, live.group_size)
    if isinstance(keys, Quantized) or isinstance(values, Quantized) or keys.shape[2] < end:
        return None
    return KVSnapshot(keys[..., :end, :], values[..., :end, :], 0, end)


def take_back(loan: Loan, caches: Sequence[LiveCache]) -> bool:
    """Copy the loan's positions from the row into the (empty) live caches."""
    rows = loan.source()
    if rows is None or len(rows) != len(caches):
        return False
    for live, (keys, values) in zip(caches, rows, strict=True):
        snap = _head(live, keys, values, loan.end)
        if snap is None or not live.restore(snap, loan.end):
            return False
    mx.eval([a for c in caches for a in c.state])
    return True


def hand_over(caches: Sequence[LiveCache], own: Sequence[object], length: int) -> bool:
    """The live caches take `own`'s buffers (a finished row holding `length` tokens that
    extend the live path): no copy. False, and nothing changed, unless every one is a
    KV cache of the live caches' kind at `length`."""
    if len(own) != len(caches) or not all(
        type(c) is type(live) and c.offset == length and c.keys is not None
        for c, live in zip(own, caches, strict=True)
    ):
        return False
    for live, row in zip(caches, own, strict=True):
        if isinstance(live, QuantizedKVCache):
            assert isinstance(row, QuantizedKVCache)
            keys, values = row.keys, row.values
            assert keys is not None and values is not None
            live.hold(keys, values, length)
        else:
            assert isinstance(row, KVCache) and row.keys is not None and row.values is not None
            live.hold(row.keys, row.values, length)
        row.free()
    # computed here, on the thread that owns the row's stream (a disk tier may read
    # the live state from another one when the engine closes)
    mx.eval([a for c in caches for a in c.state])
    return True
