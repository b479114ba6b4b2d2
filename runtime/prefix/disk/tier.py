"""The prefix cache's disk tier: paged-out state that memory evicts goes to a directory,
and comes back when a later request's longest prefix needs it; it outlives restarts.

The trie (runtime/prefix/trie.py) keeps the nodes of state on disk, each layer holding a
`DiskSnapshot` (runtime/prefix/disk/entry.py): the numbers the planner needs (base,
floor, end) and where the arrays are, no arrays. So planning is the same for memory and
disk; before a restore uses a disk snapshot, `load` reads just the layers it needs (and
verifies them). On startup `attach` rebuilds those nodes from the files' key paths, so
the first request hits.

`DiskTier` is the facade the prefix cache talks to; its parts:
- the index (runtime/prefix/disk/index.py): what is in the directory, kept under
  `max_bytes` by deleting the least recently used files; `sweep` then drops their
  snapshots from the trie;
- the writer side (runtime/prefix/disk/spill.py): eviction from memory (`spill`) turns a
  node's snapshots into disk snapshots, written by one background thread
  (runtime/prefix/disk/writer.py; files only, never MLX) from a queue bounded in bytes.
  Until its file is written an entry is read from the arrays it holds;
- reading back (`load`, here): state read back keeps a link to its file (`source`), so
  evicting it again writes nothing.

A file lock keeps a second process off the same directory: it runs without the disk
tier, with a warning.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from filelock import FileLock, Timeout

from runtime.cache import ArraySnapshot, Snapshot, codec
from runtime.prefix.disk.entry import DiskSnapshot, Entry, same_range
from runtime.prefix.disk.files import BadEntry, dtype_name, read_layers
from runtime.prefix.disk.index import DiskIndex
from runtime.prefix.disk.spill import Spiller
from runtime.prefix.disk.writer import Writer
from runtime.prefix.trie import Node, Trie

log = logging.getLogger(__name__)

DEFAULT_QUEUE_BYTES = 1 << 30  # state waiting for the writer


class DiskTier:
    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        identity: str,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.identity = identity
        self._writer = Writer(queue_bytes)
        # not thread-local: after an engine failure the tier is closed and reopened on
        # another thread, which must see (and release) the same lock
        self._lock = FileLock(str(directory / ".lock"), thread_local=False)
        self._counts: Counter[str] = Counter()
        self._index = DiskIndex(
            directory,
            max_bytes=max_bytes,
            identity=identity,
            writer=self._writer,
            counts=self._counts,
            clock=clock,
        )
        self._spiller = Spiller(self._index, self._writer, self._counts, clock)
        self.closed = True

    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        max_bytes: int,
        identity: str,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
    ) -> DiskTier | None:
        """The tier on `directory` (created if needed), or None with a warning when it
        cannot be used: not writable, or another process holds it."""
        tier = cls(directory, max_bytes=max_bytes, identity=identity, queue_bytes=queue_bytes)
        return tier if tier.reopen() else None

    def reopen(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock.acquire(timeout=0)
        except Timeout:
            log.warning(
                "prefix cache: %s is in use by another process; running without the disk tier",
                self.directory,
            )
            return False
        except OSError as exc:
            log.warning("prefix cache: cannot use %s (%s); no disk tier", self.directory, exc)
            return False
        self._index.clear()
        self._spiller.settle()
        self._spiller.failed.clear()
        self.closed = False
        return True

    def attach(self, trie: Trie) -> None:
        """Index the directory and give the trie a node, with disk snapshots, for each
        usable file (the most recently used file wins a layer two files both hold)."""
        found = self._index.scan([codec.layout_of(layer) for layer in trie.layers])
        for entry, keys in found:
            if entry.dead:
                continue
            node = trie.insert(keys, 0)
            for layer in entry.header.layers:
                if node.snapshot(layer) is None:
                    trie.set_snapshot(node, layer, DiskSnapshot(entry, layer))
        if found:
            log.info(
                "prefix cache: %d cached prefixes (%.1f MB) on disk in %s",
                len(self._index.entries), self._index.nbytes / 1e6, self.directory,
            )  # fmt: skip

    def spill(self, trie: Trie, node: Node, *, block: bool = False) -> None:
        """Move the node's in-memory snapshots to disk: back to the file they came from,
        to a file that already holds them, or to a new one (dropped when the writer's
        queue is full and not `block`, or when the file could never fit)."""
        self._spiller.spill(trie, node, block=block)

    # -- disk -> memory --

    def load(self, trie: Trie, wanted: Sequence[tuple[Node, int]]) -> bool:
        """Read the disk snapshots at `wanted` (node, layer) into memory, in place. False
        when a file was bad: it is deleted and `sweep` must run before planning again."""
        groups: dict[str, list[tuple[Node, int, DiskSnapshot]]] = {}
        for node, i in wanted:
            snap = node.snapshot(i)
            if isinstance(snap, DiskSnapshot) and not snap.closed:
                groups.setdefault(snap.entry.name, []).append((node, i, snap))
        ok = True
        for items in groups.values():
            entry = items[0][2].entry
            try:
                made = self._read(trie, entry, items)
            except (BadEntry, ValueError) as exc:
                self._index.reject(self._index.path(entry), str(exc), entry)
                ok = False
                continue
            for (node, i, disk), snap in zip(items, made, strict=True):
                snap.source = disk
                trie.replace_snapshot(node, i, snap)
            self._index.touch(entry)
        return ok

    def _read(
        self, trie: Trie, entry: Entry, items: list[tuple[Node, int, DiskSnapshot]]
    ) -> list[ArraySnapshot]:
        layers = sorted({i for _, i, _ in items})
        pending = entry.pending
        if pending is not None:  # not written yet: the snapshots' own arrays
            arrays = {i: pending[i] for i in layers}
        else:
            began = time.perf_counter()
            arrays = read_layers(self._index.path(entry), self.identity, entry.header, layers)
            self._counts["load_us"] += round((time.perf_counter() - began) * 1e6)
            self._counts["loaded_bytes"] += sum(int(a.nbytes) for g in arrays.values() for a in g)
        self._counts["loads"] += 1
        made: list[ArraySnapshot] = []
        try:
            for _, i, disk in items:
                meta = entry.header.layers[i]
                group = arrays[i]
                if [dtype_name(a) for a in group] != list(meta.dtypes):
                    raise ValueError(f"layer {i} arrays are not {meta.dtypes}")
                snap: Snapshot | None = codec.decode(
                    meta.layout, meta.base, meta.floor, meta.end, group
                )
                if disk.cut is not None and snap is not None:
                    snap, rest = trie.layers[i].split(snap, disk.cut)
                    if rest is not None:
                        rest.close()
                if not isinstance(snap, ArraySnapshot) or not same_range(disk, snap):
                    raise ValueError(f"layer {i} cannot be cut at {disk.end}")
                made.append(snap)
        except ValueError:
            for snap in made:
                snap.close()
            raise
        return made

    # -- keeping the trie in step, lifecycle, inspection --

    def sweep(self, trie: Trie) -> bool:
        """Drop the snapshots of deleted or failed files from the trie; True when any
        went (their nodes may now be prunable)."""
        self._spiller.settle()
        failed, self._spiller.failed = self._spiller.failed, []
        for entry in failed:
            self._index.delete(entry)
        if not self._index.dirty:
            return False
        self._index.dirty = False
        for node in trie.walk():
            for i, snap in enumerate(node.snapshots):
                if isinstance(snap, DiskSnapshot) and snap.closed:
                    trie.replace_snapshot(node, i, None)
                    node.evicted = True
        return True

    def flush(self) -> None:
        """Wait until every queued write and deletion is done."""
        self._writer.flush()
        self._spiller.settle()

    def close(self) -> None:
        """Finish the writes, then give the directory up (the lock)."""
        if self.closed:
            return
        self._writer.stop()
        self._spiller.settle()
        self.closed = True
        self._lock.release()

    def stats(self) -> dict[str, int]:
        return {
            "disk_entries": len(self._index.entries),
            "disk_bytes": self._index.nbytes,
            "disk_budget_bytes": self._index.max_bytes,  # lowered when the disk fills up
            **{f"disk_{k}": self._counts[k] for k in _COUNTS},
        }

    def verify(self) -> None:
        self._index.verify()


_COUNTS = (
    "writes",
    "loads",
    "loaded_bytes",
    "load_us",
    "evictions",
    "dropped",
    "too_big",
    "bad_files",
    "write_errors",
)
