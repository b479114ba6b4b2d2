"""What the disk tier holds: one file's `Entry`, and the trie's `DiskSnapshot` handle on
one layer of it (the numbers the planner needs, no arrays; runtime/prefix/disk/tier.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from runtime.cache import Snapshot, codec
from runtime.prefix.disk.files import Header, LayerMeta

# kinds whose snapshot can be cut short of its end
SPLITTABLE = (codec.KV, codec.ROTATING, codec.KV_QUANTIZED)


@dataclass(eq=False)
class Entry:
    """One file: a node's snapshots for some layers, at `end`."""

    name: str
    header: Header
    nbytes: int  # the file's size (estimated until it is written)
    last_used: float
    dead: bool = False  # deleted (or failed): its snapshots must leave the trie
    # until the writer is done (and the engine thread has heard): the snapshots' arrays,
    # which reads use meanwhile, and the arrays the writer's numpy views look into. Only
    # the engine thread drops them: MLX arrays are freed on the thread that owns MLX.
    pending: dict[int, list[mx.array]] | None = field(default=None, repr=False)
    exported: list[mx.array] | None = field(default=None, repr=False)


class DiskSnapshot:
    """One layer of an entry, or its part up to `cut` (the upper half of a split)."""

    def __init__(self, entry: Entry, layer: int, cut: int | None = None) -> None:
        self.entry = entry
        self.layer = layer
        self.meta: LayerMeta = entry.header.layers[layer]
        self.cut = cut
        self._closed = False

    @property
    def base(self) -> int:
        return self.meta.base

    @property
    def floor(self) -> int:
        return self.meta.floor

    @property
    def end(self) -> int:
        return self.meta.end if self.cut is None else self.cut

    @property
    def nbytes(self) -> int:
        return 0  # nothing in memory: the byte budget does not count it

    @property
    def closed(self) -> bool:
        return self._closed or self.entry.dead

    def close(self) -> None:
        self._closed = True  # the file stays: the disk tier's LRU decides its fate

    def split_at(self, at: int) -> tuple[Snapshot | None, Snapshot | None]:
        meta = self.meta
        if meta.layout.kind in SPLITTABLE and meta.floor <= at < self.end and meta.base < at:
            return DiskSnapshot(self.entry, self.layer, at), self
        return None, self

    def __repr__(self) -> str:
        return f"DiskSnapshot({self.entry.name[:8]}, layer {self.layer}, end={self.end})"


def same_range(disk: DiskSnapshot, snap: Snapshot) -> bool:
    """Whether `snap` covers exactly the tokens `disk` does (so it is that state)."""
    return (disk.base, disk.floor, disk.end) == (snap.base, snap.floor, snap.end)
