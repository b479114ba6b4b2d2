"""Snapshots as plain data (a kind, a few integers, arrays) and back, for the prefix
cache's disk tier.

Each snapshot type keeps its numbers (base, floor, end) and arrays; the kind names the
type so a file written by one layer's cache is never read into another kind of layer.
A latent (MLA) cache's snapshots are KV snapshots (runtime/cache/latent.py), so they
share the "kv" kind. A quantized KV cache's (runtime/cache/quantized.py) are the
"kv_quantized" kind, its bits and group size in the layout: a tier opened for another
--kv-bits finds its layers do not fit and reads none of it. Decoding checks that the arrays agree with the numbers: a file that
passed its checksum but does not describe a snapshot is still refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from runtime.cache.kv import KVCache, KVSnapshot
from runtime.cache.protocol import LayerCache, Snapshot
from runtime.cache.quantized import (
    ROTATED_KEYS,
    QuantizedKVCache,
    QuantizedSnapshot,
    group_size_for,
)
from runtime.cache.recurrent import RecurrentCache, RecurrentSnapshot
from runtime.cache.rotating import RotatingKVCache, RotatingSnapshot

KV = "kv"
ROTATING = "rotating"
RECURRENT = "recurrent"
KV_QUANTIZED = "kv_quantized"


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
    if isinstance(cache, QuantizedKVCache):
        return quantized_layout(cache.bits, cache.group_size)
    return None


def quantized_layout(bits: int, group_size: int) -> Layout:
    """A quantized KV cache's: its bits, its configured group size, and whether its
    keys are stored rotated (runtime/cache/quantized.py `rotate`, the Hadamard matrix:
    1; as they are: 0)."""
    rotation = int(ROTATED_KEYS.get(bits, False))
    return Layout(KV_QUANTIZED, {"bits": bits, "group_size": group_size, "key_rotation": rotation})


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
    if isinstance(snap, QuantizedSnapshot):
        # the cache's configured group size, as `layout_of` names it (the arrays may be
        # in groups of 32 where head_dim needs it)
        layout = quantized_layout(snap.bits, snap.configured)
        return Encoded(layout, snap.base, snap.floor, snap.end, snap.arrays)
    return None


def _quantized(layout: Layout, base: int, end: int, arrays: Sequence[mx.array]) -> Snapshot:
    bits = int(layout.params.get("bits", 0))
    configured = int(layout.params.get("group_size", 0))
    if layout != quantized_layout(bits, configured):
        raise ValueError(f"not a kv_quantized layout this server writes: {layout}")
    if len(arrays) != 6 or bits <= 0 or configured <= 0:
        raise ValueError(f"a kv_quantized snapshot has 6 arrays and its bits, got {layout}")
    if any(a.ndim != 4 or a.shape[2] != end - base for a in arrays):
        raise ValueError(f"kv_quantized arrays do not hold [{base}, {end})")
    group = 0
    for data, scales, biases in (arrays[:3], arrays[3:]):
        dim = data.shape[-1] * 32 // bits
        group = dim // max(1, scales.shape[-1])
        if data.dtype != mx.uint32 or scales.shape != biases.shape:
            raise ValueError("kv_quantized codes must be uint32, scales and biases alike")
        if group * scales.shape[-1] != dim or group != group_size_for(dim, configured):
            raise ValueError(f"kv_quantized groups of {group} do not fit {layout}")
    return QuantizedSnapshot(arrays, base, end, bits, group, configured)


def decode(layout: Layout, base: int, floor: int, end: int, arrays: Sequence[mx.array]) -> Snapshot:
    """The snapshot `encode` described; ValueError when the data does not fit."""
    if layout.kind == KV_QUANTIZED:
        return _checked(layout, base, floor, end, _quantized(layout, base, end, arrays))
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
    return _checked(layout, base, floor, end, snap)


def _checked(layout: Layout, base: int, floor: int, end: int, snap: Snapshot) -> Snapshot:
    if (snap.base, snap.floor, snap.end) != (base, floor, end):
        raise ValueError(f"{layout.kind} snapshot numbers {base}/{floor}/{end} do not match")
    return snap
