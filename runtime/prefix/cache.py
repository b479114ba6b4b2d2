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

`PrefixCache` is the facade the batch and the engine call (the lease API, lending,
inspection). Its parts: the live path and positioning (runtime/prefix/live.py),
eviction (runtime/prefix/evict.py), the disk tier hookup (runtime/prefix/persist.py),
counters and reports (runtime/prefix/stats.py), and the invariants (runtime/prefix/verify.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import mlx.core as mx

from runtime.cache import LayerCache, Snapshot
from runtime.prefix.disk.tier import DiskTier
from runtime.prefix.live import LivePath
from runtime.prefix.loan import hand_over
from runtime.prefix.persist import Persistence
from runtime.prefix.pins import Pins, label
from runtime.prefix.report import CacheReport, EvictionMemory, continuation, disabled, report
from runtime.prefix.stats import CacheStats
from runtime.prefix.trie import ImageKey, Key, Trie, image_keys
from runtime.prefix.verify import verify_live
from runtime.prefix.view import TrieView, trie_view
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


class PrefixCache(LivePath[C]):
    """The facade: the request lifecycle (`begin` .. `end`), `adopt`, `close`, and the
    inspection the debug view and tests read."""

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
        self._caches = list(make_caches()) if budget_bytes > 0 else []
        self._trie = Trie(self._caches)
        self._path = [self._trie.root]
        self._lease: Lease[C] | None = None
        self._loan = None
        self._serial = 0
        self._tick = 0
        self._stats = CacheStats(reports)
        self._counts = self._stats.counts  # bumped by eviction too
        self._pins = Pins(clock)
        self._evicted = EvictionMemory()
        if disk is not None and not self.enabled:
            disk.close()  # no cache, no disk tier
            disk = None
        self._disk = Persistence(self._trie, disk)

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
        self._stats.began(len(keys))
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
        assert lease.report is not None
        self._stats.file(lease.report)
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
        if not self._record(lease.tokens, tuple(tokens_in_cache)):
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

    def _require(self, lease: Lease[C]) -> None:
        if lease is not self._lease:
            raise ValueError("this lease is not the open one")

    def _disk_ready(self) -> None:
        """Before a request reads the trie: prune what lost its disk snapshots."""
        if self._disk.ready():
            self._prune({id(n) for n in self._path})

    def close(self) -> None:
        """Drop every cached state, live and paged out (the server is stopping: MLX
        arrays must not outlive the engine into interpreter shutdown). With a disk tier,
        write the live path and everything in memory first; a later request reopens it."""
        if self._lease is not None:
            self.discard(self._lease)
        if self._disk.open:
            self.reclaim()  # the live path goes to disk too
            try:
                self._page_out(self._path[1:])
                self._disk.save()
            except Exception:
                log.exception("prefix cache: writing the cache to disk failed")
            self._disk.close()
        self._loan = None
        for node in list(self._trie.walk()):
            self._trie.set_snapshots(node, [])  # closes them, keeping the byte count right
        self._clear_live()

    # -- inspection --

    @property
    def paged_bytes(self) -> int:
        """Snapshot bytes held in memory (what the limit bounds)."""
        return self._trie.paged_bytes

    def held_snapshots(self) -> list[Snapshot]:
        return [s for n in self._trie.walk() for s in n.snapshots if s is not None]

    def stats(self) -> dict[str, int]:
        return self._stats.summary(
            self._trie,
            live_tokens=self._path[-1].end,
            pins=len(self._pins),
            budget_bytes=self.budget_bytes,
            limit_bytes=self.limit_bytes,
            disk=self._disk.stats(),
        )

    def recent(self) -> list[CacheReport]:
        """The last requests' reports, oldest first (the newest is the last)."""
        return self._stats.recent()

    def pins(self) -> list[dict[str, object]]:
        """The live pins, soonest to expire first, with how much of each is in the trie."""
        return self._pins.describe(self._trie)

    def dump(self) -> str:
        """The trie, one node per line; `*` marks the live path."""
        return self._trie.dump(self._path)

    def view(self) -> TrieView:
        """A frozen copy of the trie's shape (runtime/prefix/view.py), with the pinned
        nodes and the one eviction would take next; on the engine's thread."""
        pinned = self._pins.nodes(self._trie)
        victim = self._pick_victim({id(n) for n in self._path}, pinned)
        return trie_view(self._trie, self._path, pinned, victim)

    def verify(self) -> None:
        """Raise AssertionError if an invariant is broken (for tests and debugging)."""
        verify_live(
            self._trie,
            self._path,
            self._caches,
            lent=self._loan is not None,
            leased=self._lease is not None,
            limit_bytes=self.limit_bytes,
        )
        self._disk.verify()


def _kept(cache: object, offset: int) -> bool:
    """Whether `cache` went past `offset` and can give its state there: a rewinding cache
    can, a recurrent one when its last chunk kept it (`capture`)."""
    if getattr(cache, "rewindable", False):
        return getattr(cache, "offset", -1) > offset
    return offset in getattr(cache, "captured", {})


__all__ = ["CacheReport", "ImageKey", "Key", "Lease", "PrefixCache", "PrefixPin", "image_keys"]
