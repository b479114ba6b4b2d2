"""The live path of the prefix cache (runtime/prefix/cache.py): where on the trie the
live caches stand, and moving them.

Positioning brings the live caches to the deepest prefix of a match every layer can
reach: it plans each layer's steps (runtime/prefix/plan.py: rewind where the cache can,
restore chains of snapshots where it cannot), splits a node the target falls inside,
reads the disk snapshots the plans use, pages out the part of the old live path being
left, and applies the plans. Recording extends the path by the tokens the caches came
to hold. Between requests the live state may be lent to a batch row instead of held
twice (runtime/prefix/loan.py). Layers that cannot rewind get restore points where a later request may need
them: at branch points, and at the offsets `snapshot_points` names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import mlx.core as mx

from runtime.cache import LayerCache, Snapshot
from runtime.prefix.evict import TrieEviction
from runtime.prefix.loan import Loan, RowState, lendable, take_back
from runtime.prefix.plan import Plan, apply_plans, deferred_steps, plan_restore
from runtime.prefix.trie import Key, Node

log = logging.getLogger("runtime.prefix.cache")  # the cache's one logger, as in evict.py

C = TypeVar("C", bound=LayerCache)

# restore points at message starts, the latest first: an agent edits the end of its
# conversation (the last user turn's reminders), rarely its first messages
MAX_BOUNDARIES = 16


class LivePath(TrieEviction, Generic[C]):
    """The live-path part of `PrefixCache` (lending, positioning, recording), over the
    state it declares here. A lockstep rank (runtime/distributed/replica.py) overrides
    the planning hooks: `_plan`, `_pinned`, `_all_rewindable`."""

    snapshot_interval: int
    tail_keep: int
    _caches: list[C]
    _tick: int
    _lease: object | None  # the open request's lease (runtime/prefix/cache.py)
    _loan: Loan | None  # the live state, lent to a batch row

    # -- lending the live state to a batch row (runtime/prefix/loan.py) --

    def lets_go(self) -> bool:
        """Whether the open lease's caches are a joining batch row's alone once it joins:
        fresh caches (no prefix cache), or live ones the trie will `lend` (every layer a
        plain KV cache). Otherwise the live caches keep their buffers, and a row written
        in place must copy them: the next request on the same live path would join with
        the same buffers, and two rows would write the same columns."""
        return not self.enabled or lendable(self._caches)

    def lend(self, source: Callable[[], RowState | None]) -> bool:
        """Between requests: the live path's state is also in a batch row (`source`
        gives the row's keys and values); drop the live caches' copy until it is next
        needed. False (nothing changed) unless every layer is a plain KV cache."""
        end = self._path[-1].end
        if not self.enabled or self._lease is not None or self._loan is not None:
            return False
        if end == 0 or not lendable(self._caches):
            return False
        for cache in self._caches:
            cache.free()
        self._loan = Loan(source, end)
        return True

    def reclaim(self) -> None:
        """Take a lent live path back from its batch row now (also before an abort drops
        the batch); where the row is gone, or its arrays cannot be read (left on the
        stream of a worker that died), drop the live path instead."""
        loan, self._loan = self._loan, None
        if loan is None:
            return
        try:
            back = take_back(loan, self._caches)  # type: ignore[arg-type]
        except RuntimeError as e:
            log.info("prefix cache: taking the live path back failed (%s)", e)
            back = False
        if not back:
            log.info("prefix cache: the batch row holding the live path is gone; dropping it")
            self._clear_live()
            self._enforce_budget()

    def _position(
        self, path: list[Node], matched: int, *, use_disk: bool = True
    ) -> tuple[int, int, bool]:
        """Bring the live caches to the deepest reachable prefix of the matched `path`;
        return (it, match end, whether a restore failed)."""
        branch = matched
        while True:
            held = self._live_common(path, matched)
            target, plans = self._plan(path, matched, held, use_disk)
            inner = next((j for j, n in enumerate(path) if n.start < target < n.end), None)
            if inner is not None:
                upper = self._trie.split(path[inner], target)
                if path[inner] in self._path:
                    self._path.insert(self._path.index(path[inner]), upper)
                path, matched = [*path[:inner], upper], target
            elif self._disk.read(deferred_steps(path, plans)):
                break
        live = [n for n in path if n.end <= target]
        kept = {id(n) for n in live}
        self._page_out([n for n in self._path if id(n) not in kept])
        if not apply_plans(self._caches, path, plans, target):
            log.warning("prefix cache: restore failed; starting clean")
            self._counts["restore_failures"] += 1
            self._clear_live()
            return 0, branch, True
        self._path = live
        for node in live:
            node.last_used = self._tick
        if target > 0 and live[-1].children:
            self._fill(live[-1])  # a branch point: give caches that cannot rewind a restore point
        mx.eval([a for c in self._caches for a in c.state])
        self._enforce_budget()
        return target, branch, False

    def _plan(
        self, path: list[Node], matched: int, live: int, use_disk: bool
    ) -> tuple[int, list[Plan]]:
        """The deepest offset every layer reaches, and each layer's steps. (A pipeline
        rank of a distributed group holds some layers only: the ranks agree on the
        offset, runtime/distributed/replica.py.)"""
        return plan_restore(self._caches, path, matched, live, use_disk)

    def _live_common(self, path: list[Node], matched: int) -> int:
        """How many of the matched tokens the live caches already hold."""
        k = 0
        while k < len(path) and k < len(self._path) and path[k] is self._path[k]:
            k += 1
        if k < len(path) and k < len(self._path):
            return min(matched, path[k - 1].end)  # the paths part at a node boundary
        return min(matched, self._path[-1].end)

    def _page_out(self, leaving: list[Node]) -> None:
        """Snapshot what the live caches hold for nodes about to lose live backing.

        `leaving` is the tail of the live path; its last node ends at the live offset. One
        snapshot per layer is taken from the first node lacking one and split at each node
        end (caches that cannot split give only the last node its part).
        """
        if not leaving:
            return
        for i, cache in enumerate(self._caches):
            first = next((j for j, n in enumerate(leaving) if n.snapshot(i) is None), None)
            if first is None:
                continue
            rest = cache.snapshot(leaving[first].start)
            for node in leaving[first:]:
                if rest is None:
                    break
                part: Snapshot | None
                if node is leaving[-1]:
                    part, rest = rest, None
                else:
                    part, rest = cache.split(rest, node.end)
                if part is None:
                    continue
                if node.snapshot(i) is None and part.end == node.end:
                    self._trie.set_snapshot(node, i, part)
                    self._counts["page_outs"] += 1
                else:
                    part.close()
            if rest is not None:
                rest.close()

    def _fill(self, node: Node) -> None:
        """Snapshot, at the live offset `node.end`, the layers that cannot rewind to it later."""
        for i, cache in enumerate(self._caches):
            if cache.rewindable or node.snapshot(i) is not None:
                continue
            # passed on the way (`_kept` in cache.py): the state the chunk kept there
            at = {} if cache.offset == node.end else {"at": node.end}
            snap = cache.snapshot(node.start, **at)
            if snap is not None:
                self._trie.set_snapshot(node, i, snap)

    def _snapshot_points(
        self, length: int, reused: int, branch: int, boundaries: Sequence[int] = ()
    ) -> tuple[int, ...]:
        if self._all_rewindable():
            return ()  # live state rewinds anywhere; paging out covers the rest
        step = self.snapshot_interval
        points = {branch, length - self.tail_keep, *boundaries[-MAX_BOUNDARIES:]}
        points.update(range((reused // step + 1) * step, length, step))
        return tuple(sorted(p for p in points if reused < p < length))

    def _pinned(self, leaf: Node) -> bool:
        """Whether a snapshot pins `leaf`'s end, so that the trie adds a node after it
        instead of growing it (a pipeline rank answers for the whole group's layers)."""
        return leaf.has_snapshots()

    def _all_rewindable(self) -> bool:
        """Whether every layer's live state rewinds anywhere (then prefill never pauses
        for snapshots; a pipeline rank answers for the whole group's layers)."""
        return all(c.rewindable for c in self._caches)

    def _record(self, prompt: tuple[Key, ...], keys: tuple[Key, ...]) -> bool:
        """Extend the live path by what the caches hold past it: `keys` (the request's
        `prompt`, then its output). False when the caches disagree with them."""
        offsets = {c.offset for c in self._caches}
        if len(offsets) != 1:
            return False
        held = offsets.pop()
        if held > len(keys):
            # the caches hold tokens the caller did not name: drop them if possible
            if not all(c.restore(None, len(keys)) for c in self._caches):
                return False
            held = len(keys)
        frontier = self._path[-1]
        shared = min(held, len(prompt))
        if held < frontier.end or keys[:shared] != prompt[:shared]:
            return False
        self._path += self._trie.advance(
            frontier, keys[frontier.end : held], self._tick, self._pinned
        )
        for node in self._path:
            node.last_used = self._tick
        return True

    def _extends_live(self, keys: tuple[Key, ...]) -> bool:
        end = self._path[-1].end
        return len(keys) >= end and keys[:end] == tuple(
            k for node in self._path[1:] for k in node.keys
        )

    def _clear_live(self) -> None:
        for cache in self._caches:
            cache.free()
        self._path = [self._trie.root]
