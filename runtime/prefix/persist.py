"""The prefix cache's hookup to its disk tier (runtime/prefix/disk/tier.py).

Everything the cache asks of the tier goes through `Persistence`, with the trie bound:
read the disk snapshots a restore plans to use, spill what memory evicts, drop what the
tier deleted, and on `close` move everything held in memory to disk. Without a tier
(none configured, or one that could not be reopened) each of these does nothing, and
eviction drops state instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.prefix.disk.tier import DiskTier
from runtime.prefix.trie import Node, Trie


class Persistence:
    """The cache's disk tier, or none; `tier` is None when the cache has no disk."""

    def __init__(self, trie: Trie, tier: DiskTier | None) -> None:
        self._trie = trie
        self.tier = tier
        if tier is not None:
            tier.attach(trie)

    @property
    def active(self) -> bool:
        """Whether eviction moves snapshots to disk (instead of dropping them)."""
        return self.tier is not None

    @property
    def open(self) -> bool:
        return self.tier is not None and not self.tier.closed

    def ready(self) -> bool:
        """Before a request reads the trie: reopen a tier `close` gave up (the engine
        restarted after a failure) and drop snapshots whose files are gone; True when
        any went (their nodes may now be prunable)."""
        if self.tier is None:
            return False
        if self.tier.closed:
            if not self.tier.reopen():
                self.tier = None
                return False
            self.tier.attach(self._trie)
        return self.tier.sweep(self._trie)

    def read(self, wanted: Sequence[tuple[Node, int]]) -> bool:
        """Read the disk snapshots at `wanted` (node, layer) into memory; False when a
        file was bad (it is gone from the trie now: plan again)."""
        if not wanted or self.tier is None or self.tier.load(self._trie, wanted):
            return True
        self.tier.sweep(self._trie)
        return False

    def spill(self, node: Node) -> None:
        """Move the node's in-memory snapshots to disk (dropped when the writer is
        swamped)."""
        if self.tier is not None:
            self.tier.spill(self._trie, node)

    def sweep(self) -> bool:
        """Drop the snapshots of files the tier deleted (to stay in its bound)."""
        return self.tier is not None and self.tier.sweep(self._trie)

    def save(self) -> None:
        """Move every in-memory snapshot to disk, least recently used first (so the
        disk's LRU bound drops those first), and wait for the writes."""
        if self.tier is None:
            return
        held = [n for n in self._trie.walk() if n.snapshot_bytes()]
        for node in sorted(held, key=lambda n: (n.last_used, n.end)):
            self.tier.spill(self._trie, node, block=True)
        self.tier.flush()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()

    def stats(self) -> dict[str, int] | None:
        return None if self.tier is None else self.tier.stats()

    def verify(self) -> None:
        if self.tier is not None:
            self.tier.verify()
