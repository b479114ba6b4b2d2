"""Snapshots as plain data (a kind, a few integers, arrays) and back, for the prefix
cache's disk tier.

Each snapshot type keeps its numbers (base, floor, end) and arrays; the kind names the
type so a file written by one layer's cache is never read into another kind of layer.
A latent (MLA) cache's snapshots are KV snapshots (runtime/cache/latent.py), so they
share the "kv" kind. Decoding checks that the arrays agree with the numbers: a file that
passed its checksum but does not describe a snapshot is still refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from runtime.cache.kv import KVCache, KVSnapshot
from runtime.cache.protocol import LayerCache, Snapshot
from runtime.cache.recurrent import RecurrentCache, RecurrentSnapshot
from runtime.cache.rotating import RotatingKVCache, RotatingSnapshot

KV = "kv"
ROTATING = "rotating"
RECURRENT = "recurrent"


@dataclass(frozen=True)
class Layout:
    """What a layer's snapshots look like: the kind and its fixed parameters."""

    kind: str
    params: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Encoded:
    """A snapshot as data: `arrays` in the order `decode` takes them."""

    layout: Layout
    base: int
    floor: int
    end: int
    arrays: tuple[mx.array, ...]


def layout_of(cache: LayerCache) -> Layout | None:
    """The layout of the snapshots `cache` makes; None for a cache with no codec."""
    if isinstance(cache, RotatingKVCache):
        return Layout(ROTATING, {"max_size": cache.max_size})
    if isinstance(cache, KVCache):  # LatentCache too
        return Layout(KV)
    if isinstance(cache, RecurrentCache):
        return Layout(RECURRENT)
    return None


def encode(snap: Snapshot) -> Encoded | None:
    """The snapshot's data (its arrays, not copies); None for a type with no codec or
    a closed snapshot."""
    if snap.closed:
        return None
    if isinstance(snap, RotatingSnapshot):
        layout = Layout(ROTATING, {"max_size": snap.max_size})
        return Encoded(layout, snap.base, snap.floor, snap.end, (snap.keys, snap.values))
    if isinstance(snap, KVSnapshot):
        return Encoded(Layout(KV), snap.base, snap.floor, snap.end, (snap.keys, snap.values))
    if isinstance(snap, RecurrentSnapshot):
        arrays = (snap.conv_state, snap.recurrent_state)
        return Encoded(Layout(RECURRENT), snap.base, snap.floor, snap.end, arrays)
    return None


def decode(layout: Layout, base: int, floor: int, end: int, arrays: Sequence[mx.array]) -> Snapshot:
    """The snapshot `encode` described; ValueError when the data does not fit."""
    if len(arrays) != 2:
        raise ValueError(f"a {layout.kind} snapshot has 2 arrays, got {len(arrays)}")
    first, second = arrays
    snap: Snapshot
    if layout.kind == KV:
        if first.ndim != 4 or first.shape[2] != end - base or second.shape[2] != end - base:
            raise ValueError(f"kv arrays {first.shape}, {second.shape} do not hold [{base}, {end})")
        snap = KVSnapshot(first, second, base, end)
    elif layout.kind == ROTATING:
        max_size = int(layout.params.get("max_size", 0))
        if first.ndim != 4 or not 0 < first.shape[2] <= max_size:
            raise ValueError(f"rotating arrays {first.shape} do not fit a window of {max_size}")
        snap = RotatingSnapshot(first, second, end, max_size)
    elif layout.kind == RECURRENT:
        snap = RecurrentSnapshot(first, second, end)
    else:
        raise ValueError(f"unknown snapshot kind {layout.kind!r}")
    if (snap.base, snap.floor, snap.end) != (base, floor, end):
        raise ValueError(f"{layout.kind} snapshot numbers {base}/{floor}/{end} do not match")
    return snap
