"""Eviction for the prefix cache (runtime/prefix/cache.py): keeping the snapshots held
in memory within the limit.

Least recently used nodes go first (then the deepest, then the largest), off the live
path before on it and unpinned before pinned; a removal that leaves a node with one
child merges the chain. With a disk tier a node's snapshots move to disk instead, and
the node stays. What no snapshot can restore any more is pruned.
"""

from __future__ import annotations

import logging
from collections import Counter

from runtime.prefix.persist import Persistence
from runtime.prefix.pins import Pins
from runtime.prefix.report import EvictionMemory
from runtime.prefix.trie import Node, Trie

log = logging.getLogger("runtime.prefix.cache")


class TrieEviction:
    """The eviction part of `PrefixCache`, over the state it declares here."""

    budget_bytes: int
    limit_bytes: int
    _trie: Trie
    _path: list[Node]
    _disk: Persistence
    _pins: Pins
    _counts: Counter[str]
    _evicted: EvictionMemory

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def set_limit(self, limit: int) -> None:
        """Hold at most `limit` bytes in memory (never more than the budget): the
        running batch shares one memory bound with the trie and comes first. Lowering it
        evicts (to the disk tier when there is one) at once."""
        limit = min(self.budget_bytes, max(0, limit))
        lower = limit < self.limit_bytes
        self.limit_bytes = limit
        if lower and self.enabled and self._trie.paged_bytes > limit:
            self._enforce_budget()

    def _enforce_budget(self) -> None:
        active = {id(n) for n in self._path}
        self._evict_over_budget(active)
        self._disk.sweep()  # files the disk tier deleted to stay in its bound
        self._prune(active)

    def _evict_over_budget(self, active: set[int]) -> None:
        """Evict until the paged-out snapshots fit the budget. (The ranks of a
        distributed group hold different shards, so their bytes differ: their lockstep
        cache, runtime/distributed/lockstep.py, evicts only between steps, as rank 0
        decides for all of them.)"""
        pinned: set[int] | None = None  # found only when something must go
        while self._trie.paged_bytes > self.limit_bytes:
            if pinned is None:
                pinned = self._pins.nodes(self._trie)
            victim = self._pick_victim(active, pinned)
            if victim is None:
                break
            if id(victim) in pinned:
                # memory safety wins over a client's pin, but say so
                log.warning(
                    "prefix cache: evicting pinned state at tokens [%d, %d): the pinned "
                    "prompts alone exceed the memory left to the trie (%d bytes)",
                    victim.start, victim.end, self.limit_bytes,
                )  # fmt: skip
                self._counts["pinned_evictions"] += 1
            self._evict(victim, active)
            self._counts["evictions"] += 1

    def _pick_victim(self, active: set[int], pinned: set[int]) -> Node | None:
        """Off the live path first, unpinned first; then least recently used, deepest,
        largest."""
        best: Node | None = None
        best_key: tuple[bool, bool, int, int, int] | None = None
        for node in self._trie.walk():
            if not node.snapshot_bytes():
                continue  # nothing in memory (disk snapshots hold none)
            key = (
                id(node) in active,
                id(node) in pinned,
                node.last_used,
                -node.end,
                -node.snapshot_bytes(),
            )
            if best_key is None or key < best_key:
                best, best_key = node, key
        return best

    def _evict(self, node: Node, active: set[int]) -> None:
        if self._disk.active:
            self._disk.spill(node)  # dropped only when the writer is swamped
            if node.has_snapshots():
                return
            node.evicted = True
            if id(node) not in active and not node.children:
                self._evicted.remember(node)
                parent = node.parent
                self._trie.remove_leaf(node)
                self._merge_chain(parent, active)
            return
        if id(node) in active or len(node.children) > 1:
            self._trie.set_snapshots(node, [])  # keep the node: a branch, or live
            node.evicted = True
        elif node.children:
            self._trie.merge_with_child(node)
            node.evicted = True  # its own part of the edge lost its restore point
        else:
            parent = node.parent
            self._evicted.remember(node)
            self._trie.remove_leaf(node)
            self._merge_chain(parent, active)

    def _merge_chain(self, node: Node | None, active: set[int]) -> None:
        """A node left with one child after a removal is no longer a branch: fold it."""
        if node is None or node is self._trie.root or id(node) in active:
            return
        if node.parent is not None and len(node.children) == 1:
            (child,) = node.children.values()
            if node.has_deferred() or child.has_deferred():
                return  # disk snapshots cannot be merged without reading them
            self._trie.merge_with_child(node)

    def _prune(self, active: set[int]) -> None:
        """Remove nodes off the live path with no snapshot in their subtree: nothing in
        them can be restored."""
        order = list(self._trie.walk())
        useful: dict[int, bool] = {}
        for node in reversed(order):  # descendants before ancestors
            useful[id(node)] = (
                id(node) in active
                or node.has_snapshots()
                or any(useful[id(c)] for c in node.children.values())
            )
        orphaned: dict[int, Node] = {}
        for node in reversed(order):
            if not useful[id(node)] and node.parent is not None:
                if useful[id(node.parent)]:
                    orphaned[id(node.parent)] = node.parent
                if node.evicted:
                    self._evicted.remember(node)
                self._trie.remove_leaf(node)
        for parent in orphaned.values():
            self._merge_chain(parent, active)
