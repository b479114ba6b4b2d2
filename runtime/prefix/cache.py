"""The shared prefix cache: conversations that share a prefix reuse its computed state.

One path of the trie (runtime/prefix/trie.py) is live: the per-layer caches hold its
tokens. Every other node is paged out: it holds snapshots. A request:

1. `begin(tokens)` finds the longest cached prefix (always leaving one token to run), plans
   for each layer how to reach the deepest offset every layer can reach (rewinding the live
   state where the cache can, restoring chains of snapshots where it cannot), pages out
   the part of the old live path being left, and positions the caches there.
2. Prefill pauses at `lease.snapshot_points` and calls `snapshot_at`, so caches that
   cannot rewind get restore points: where this prompt leaves the trie (a future branch
   point), a few tokens before the prompt ends (regenerating reuses the whole prompt), and
   every `snapshot_interval` tokens.
3. `end(lease, tokens)` records the tokens whose state the caches hold (prompt and output,
   also for a cancelled request); `discard(lease)` drops the live state after an error.

Snapshot bytes are kept within `budget_bytes` (lowered by `set_limit` while the running
batch needs the memory) by evicting the least recently used nodes
(then the deepest, then the largest), merging chains a removal leaves single-child. With
a disk tier (runtime/prefix/disk/tier.py) eviction moves a node's snapshots to disk instead:
the node stays, its layers hold disk snapshots the planner treats like any other, and
those a restore needs are read back first. `close` writes the live path and all that is
in memory there too; a new cache on the same directory starts with the trie rebuilt.
Nodes holding a pinned prompt (runtime/prefix/pins.py) go after every unpinned one; when
only pinned state is left over the budget it is evicted too (memory wins), with a log
line. The invariant: with greedy sampling, any sequence of requests yields the same
tokens as running every request from scratch. A failed restore falls back to a clean
state. Each `begin` files a report of what was reused and why not more
(runtime/prefix/report.py); the last few are kept for the debug view.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import mlx.core as mx

from runtime.cache import LayerCache, Snapshot
from runtime.prefix.disk.tier import DiskTier
from runtime.prefix.evict import TrieEviction
from runtime.prefix.loan import Loan, RowState, hand_over, lendable, take_back
from runtime.prefix.pins import Pins, label
from runtime.prefix.plan import Plan, apply_plans, deferred_steps, plan_restore
from runtime.prefix.report import CacheReport, EvictionMemory, continuation, disabled, report
from runtime.prefix.trie import DeferredSnapshot, ImageKey, Key, Node, Trie, image_keys
from runtime.types import PrefixPin

log = logging.getLogger(__name__)

C = TypeVar("C", bound=LayerCache)


@dataclass(frozen=True, eq=False)
class Lease(Generic[C]):
    """One request's use of the live caches, from `begin` to `end` or `discard`.

    `caches` hold the first `reused` tokens of `tokens`; prefill must pause at each offset
    in `snapshot_points` (ascending, all > reused and < len(tokens)) and call `snapshot_at`.
    """

    caches: list[C]
    reused: int
    snapshot_points: tuple[int, ...]
    tokens: tuple[Key, ...]
    serial: int
    report: CacheReport | None = None  # what was reused, and why not more


class PrefixCache(TrieEviction, Generic[C]):
    def __init__(
        self,
        make_caches: Callable[[], Sequence[C]],
        *,
        budget_bytes: int,
        snapshot_interval: int = 1024,
        tail_keep: int = 4,
        clock: Callable[[], float] = time.monotonic,
        reports: int = 32,
        disk: DiskTier | None = None,
    ) -> None:
        if budget_bytes < 0 or snapshot_interval < 1 or tail_keep < 1:
            raise ValueError("budget_bytes >= 0, snapshot_interval >= 1, tail_keep >= 1")
        self._make = make_caches
        self.budget_bytes = budget_bytes
        self.limit_bytes = budget_bytes  # lowered while the running batch needs memory
        self.snapshot_interval = snapshot_interval
        self.tail_keep = tail_keep
        self._caches: list[C] = list(make_caches()) if budget_bytes > 0 else []
        self._trie = Trie(self._caches)
        self._path: list[Node] = [self._trie.root]
        self._lease: Lease[C] | None = None
        self._loan: Loan | None = None  # the live state, lent to a batch row
        self._serial = 0
        self._tick = 0
        self._counts: Counter[str] = Counter()
        self._pins = Pins(clock)
        self._evicted = EvictionMemory()
        self._reports: deque[CacheReport] = deque(maxlen=reports)
        self._disk = disk if self.enabled else None
        if disk is not None and self._disk is None:
            disk.close()  # no cache, no disk tier
        if self._disk is not None:
            self._disk.attach(self._trie)

    # -- the request lifecycle --

    def begin(
        self,
        tokens: Sequence[Key],
        *,
        pin: PrefixPin | None = None,
        boundaries: Sequence[int] = (),
    ) -> Lease[C]:
        """Position the live caches on the longest usable cached prefix of `tokens`;
        a `pin` keeps this prompt ahead of unpinned state in eviction for its TTL.
        `boundaries` (where the prompt's messages start) become restore points for
        caches that cannot rewind: where a later request editing a message diverges."""
        if not tokens:
            raise ValueError("cannot begin an empty prompt")
        if self._lease is not None:
            log.warning("prefix cache: begin() while a lease is open; discarding it")
            self.discard(self._lease)
        keys = tuple(tokens)
        self._serial += 1
        self._counts["requests"] += 1
        self._counts["prompt_tokens"] += len(keys)
        tag = None if pin is None else label(pin)
        if not self.enabled:
            lease = Lease(
                list(self._make()), 0, (), keys, self._serial,
                disabled(self._serial, len(keys), tag),
            )  # fmt: skip
        else:
            self._tick += 1
            if pin is not None:
                self._pins.add(keys, pin)
            lease = self._begin_cached(keys, tag, boundaries)
            self._counts["hits"] += lease.reused > 0
            self._counts["reused_tokens"] += lease.reused
        assert lease.report is not None
        self._reports.append(lease.report)
        self._lease = lease
        return lease

    def _begin_cached(
        self, keys: tuple[Key, ...], tag: str | None, boundaries: Sequence[int]
    ) -> Lease[C]:
        self.reclaim()
        self._disk_ready()
        path, matched = self._trie.match(keys[:-1])  # always leave one token to run
        cached = continuation(path, matched)
        evicted = [(n.end, n.evicted) for n in path[1:]]
        after = matched < len(keys) - 1 and self._evicted.knows(keys, matched)
        try:
            reused, branch, failed = self._position(path, matched)
        except Exception:
            log.exception("prefix cache: positioning failed; starting clean")
            self._counts["restore_failures"] += 1
            self._clear_live()
            reused, branch, failed = 0, 0, True
        points = self._snapshot_points(len(keys), reused, branch, boundaries)
        why = report(
            serial=self._serial,
            keys=keys,
            matched=matched,
            reused=reused,
            cached=cached,
            evicted_on_path=any(flag and end > reused for end, flag in evicted),
            evicted_after=after,
            failed=failed,
            pin=tag,
        )
        log.debug("prefix cache: reused %d of %d tokens (%s)", reused, len(keys), why.reason.value)
        return Lease(self._caches, reused, points, keys, self._serial, why)

    def snapshot_at(self, lease: Lease[C], offset: int) -> None:
        """Called by prefill when every cache is at `offset` (one of the snapshot points)."""
        self._require(lease)
        if not self.enabled:
            return
        if not 0 < offset <= len(lease.tokens):
            raise ValueError(f"snapshot offset {offset} outside the prompt")
        if any(c.offset != offset and not _kept(c, offset) for c in self._caches):
            raise ValueError(f"caches are not all at offset {offset}, nor kept it")
        frontier = self._path[-1]
        if offset <= frontier.end:
            return
        added = self._trie.advance(
            frontier, lease.tokens[frontier.end : offset], self._tick, self._pinned
        )
        self._path += added
        self._fill(self._path[-1])
        self._enforce_budget()

    def end(self, lease: Lease[C], tokens_in_cache: Sequence[Key]) -> None:
        """The request finished, was cancelled or failed cleanly: record the path.

        `tokens_in_cache` are the prompt followed by the generated tokens whose state is in
        the caches (its length is the caches' offset; extra trailing tokens are ignored).
        """
        self._require(lease)
        self._lease = None
        if not self.enabled:
            for cache in lease.caches:
                cache.free()
            return
        self._tick += 1
        if not self._record(lease, tuple(tokens_in_cache)):
            log.warning("prefix cache: caches disagree with the tokens; dropping live state")
            self._counts["discards"] += 1
            self._clear_live()
        self._enforce_budget()

    def adopt(self, tokens: Sequence[Key], caches: Sequence[LayerCache]) -> bool:
        """Record a sequence whose state was computed outside the live caches (a batch
        row): position the live caches on the longest cached prefix of `tokens`, copy the
        rest of `caches`' state in (their offset is `len(tokens)`), record the path.

        Not a request: no report, no counters but `adopted`. False when a cache could
        not take the state (the live state is then dropped, as after an error).
        """
        if not self.enabled or not tokens:
            return False
        if self._lease is not None:
            raise ValueError("adopt() while a lease is open")
        keys = tuple(tokens)
        self._tick += 1
        lent = self._loan is not None and self._extends_live(keys)
        if lent and hand_over(self._caches, caches, len(keys)):  # type: ignore[arg-type]
            self._loan = None  # the lent live path came back, with the row's output
            return self._adopted(Lease(self._caches, len(keys), (), keys, self._serial))
        self.reclaim()
        self._disk_ready()
        path, matched = self._trie.match(keys[:-1])
        try:
            # `caches` hold all of it: reading from disk would only slow this down
            reused, _, _ = self._position(path, matched, use_disk=False)
        except Exception:
            log.exception("prefix cache: positioning failed; starting clean")
            self._clear_live()
            reused = 0
        lease = Lease(self._caches, reused, (), keys, self._serial)
        self._lease = lease
        for live, own in zip(self._caches, caches, strict=True):
            if own.offset != len(keys) or not live.restore(own.snapshot(reused), len(keys)):
                log.warning("prefix cache: a finished sequence's state could not be adopted")
                self.discard(lease)
                return False
        # evaluated here, on the thread whose stream built it: `close` may run on another
        mx.eval([a for c in self._caches for a in c.state])
        return self._adopted(lease)

    def _adopted(self, lease: Lease[C]) -> bool:
        self._lease = lease
        self._counts["adopted"] += 1
        self.end(lease, lease.tokens)
        return True

    # -- lending the live state to a batch row (runtime/prefix/loan.py) --

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

    def _extends_live(self, keys: tuple[Key, ...]) -> bool:
        end = self._path[-1].end
        return len(keys) >= end and keys[:end] == tuple(
            k for node in self._path[1:] for k in node.keys
        )

    def discard(self, lease: Lease[C]) -> None:
        """An error left the caches in an unknown state: drop the live state."""
        if lease is not self._lease:
            return
        self._lease = None
        self._counts["discards"] += 1
        if not self.enabled:
            for cache in lease.caches:
                cache.free()
            return
        self._clear_live()
        self._enforce_budget()

    # -- positioning --

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
            elif self._read_planned(path, plans):
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

    def _read_planned(self, path: list[Node], plans: list[Plan]) -> bool:
        """Read the disk snapshots the plans use into memory; False when a file was bad
        (it is gone from the trie now: plan again)."""
        wanted = deferred_steps(path, plans)
        if not wanted or self._disk is None or self._disk.load(self._trie, wanted):
            return True
        self._disk.sweep(self._trie)
        return False

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
            # passed on the way (`_kept`): the state the chunk kept there
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

    # -- recording, clearing --

    def _record(self, lease: Lease[C], keys: tuple[Key, ...]) -> bool:
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
        shared = min(held, len(lease.tokens))
        if held < frontier.end or keys[:shared] != lease.tokens[:shared]:
            return False
        self._path += self._trie.advance(
            frontier, keys[frontier.end : held], self._tick, self._pinned
        )
        for node in self._path:
            node.last_used = self._tick
        return True

    def _clear_live(self) -> None:
        for cache in self._caches:
            cache.free()
        self._path = [self._trie.root]

    def _require(self, lease: Lease[C]) -> None:
        if lease is not self._lease:
            raise ValueError("this lease is not the open one")

    def close(self) -> None:
        """Drop every cached state, live and paged out (the server is stopping: MLX
        arrays must not outlive the engine into interpreter shutdown). With a disk tier,
        write the live path and everything in memory first; a later request reopens it."""
        if self._lease is not None:
            self.discard(self._lease)
        if self._disk is not None and not self._disk.closed:
            self.reclaim()  # the live path goes to disk too
            try:
                self._persist()
            except Exception:
                log.exception("prefix cache: writing the cache to disk failed")
            self._disk.close()
        self._loan = None
        for node in list(self._trie.walk()):
            self._trie.set_snapshots(node, [])  # closes them, keeping the byte count right
        self._clear_live()

    def _persist(self) -> None:
        """Page the live path out, then move every in-memory snapshot to disk, least
        recently used first (so the disk's LRU bound drops those first)."""
        assert self._disk is not None
        self._page_out(self._path[1:])
        held = [n for n in self._trie.walk() if n.snapshot_bytes()]
        for node in sorted(held, key=lambda n: (n.last_used, n.end)):
            self._disk.spill(self._trie, node, block=True)
        self._disk.flush()

    def _disk_ready(self) -> None:
        """Before a request reads the trie: reopen a disk tier `close` gave up (the
        engine restarted after a failure) and drop snapshots whose files are gone."""
        if self._disk is None:
            return
        if self._disk.closed:
            if not self._disk.reopen():
                self._disk = None
                return
            self._disk.attach(self._trie)
        if self._disk.sweep(self._trie):
            self._prune({id(n) for n in self._path})

    # -- inspection --

    @property
    def paged_bytes(self) -> int:
        """Snapshot bytes held in memory (what the limit bounds)."""
        return self._trie.paged_bytes

    def held_snapshots(self) -> list[Snapshot]:
        return [s for n in self._trie.walk() for s in n.snapshots if s is not None]

    def stats(self) -> dict[str, int]:
        nodes = list(self._trie.walk())
        held = [s for n in nodes for s in n.snapshots if s is not None]
        on_disk = sum(isinstance(s, DeferredSnapshot) for s in held)
        return {
            **{k: self._counts[k] for k in _COUNTS},
            "nodes": len(nodes) - 1,
            "snapshots": len(held) - on_disk,
            "paged_bytes": self._trie.paged_bytes,
            "budget_bytes": self.budget_bytes,
            "limit_bytes": self.limit_bytes,
            "live_tokens": self._path[-1].end,
            "pins": len(self._pins),
            **({} if self._disk is None else {"disk_snapshots": on_disk, **self._disk.stats()}),
        }

    def recent(self) -> list[CacheReport]:
        """The last requests' reports, oldest first (the newest is the last)."""
        return list(self._reports)

    def pins(self) -> list[dict[str, object]]:
        """The live pins, soonest to expire first, with how much of each is in the trie."""
        return self._pins.describe(self._trie)

    def dump(self) -> str:
        """The trie, one node per line; `*` marks the live path."""
        return self._trie.dump(self._path)

    def verify(self) -> None:
        """Raise AssertionError if an invariant is broken (for tests and debugging)."""
        self._trie.verify()
        if self._path[0] is not self._trie.root:
            raise AssertionError("the live path does not start at the root")
        for upper, lower in zip(self._path, self._path[1:], strict=False):
            if lower.parent is not upper:
                raise AssertionError(f"live path broken between {upper} and {lower}")
        live = self._path[-1].end
        offsets = {c.offset for c in self._caches}
        if self._loan is not None:
            offsets = {live}  # lent: the live caches are empty until taken back
        if self._lease is None and offsets and offsets != {live}:
            raise AssertionError(f"live caches at {offsets}, live path ends at {live}")
        if any(o < live for o in offsets):
            raise AssertionError(f"live caches at {offsets} behind the live path end {live}")
        if self._trie.paged_bytes > self.limit_bytes:
            raise AssertionError(f"{self._trie.paged_bytes} bytes held, limit {self.limit_bytes}")
        if self._disk is not None:
            self._disk.verify()


# restore points at message starts, the latest first: an agent edits the end of its
# conversation (the last user turn's reminders), rarely its first messages
MAX_BOUNDARIES = 16


def _kept(cache: object, offset: int) -> bool:
    """Whether `cache` went past `offset` and can give its state there: a rewinding cache
    can, a recurrent one when its last chunk kept it (`capture`)."""
    if getattr(cache, "rewindable", False):
        return getattr(cache, "offset", -1) > offset
    return offset in getattr(cache, "captured", {})


_COUNTS: tuple[str, ...] = ("requests", "hits", "prompt_tokens", "reused_tokens", "page_outs")
_COUNTS += ("evictions", "pinned_evictions", "restore_failures", "discards", "adopted")


__all__ = ["CacheReport", "ImageKey", "Key", "Lease", "PrefixCache", "PrefixPin", "image_keys"]
