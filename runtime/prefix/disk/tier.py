"""The prefix cache's disk tier: paged-out state that memory evicts goes to a directory,
and comes back when a later request's longest prefix needs it; it outlives restarts.

The trie (runtime/prefix/trie.py) keeps the nodes of state on disk, each layer holding a
`DiskSnapshot`: the numbers the planner needs (base, floor, end) and where the arrays
are, no arrays. So planning is the same for memory and disk; before a restore uses a
disk snapshot, `load` reads just the layers it needs (and verifies them). On startup
`attach` rebuilds those nodes from the files' key paths, so the first request hits.

Eviction from memory (`spill`) turns a node's snapshots into disk snapshots: the engine
thread evaluates the arrays and hands zero-copy numpy views of them to a background
writer (one thread, a queue bounded in bytes; files only, never MLX), which writes the
file (runtime/prefix/disk/files.py). The arrays stay referenced until the engine thread hears
the write is done, and are freed there. When the queue is full the state is dropped, as
it was before the disk tier; `close` waits instead. Until its file is written an entry
is read from those arrays. State read back keeps a link to its file (`source`), so
evicting it again writes nothing. The directory is kept under `max_bytes` by deleting
the least recently used files; `sweep` then drops their snapshots from the trie. A file
lock keeps a second process off the same directory: it runs without the disk tier, with
a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from filelock import FileLock, Timeout

from runtime.cache import ArraySnapshot, Snapshot
from runtime.cache.codec import KV, ROTATING, Encoded, Layout, decode, encode, layout_of
from runtime.prefix.disk.files import (
    SUFFIX,
    TMP_SUFFIX,
    BadEntry,
    Header,
    LayerMeta,
    content_name,
    dtype_name,
    encode_keys,
    export,
    read_header,
    read_layers,
    size_bound,
    write_entry,
)
from runtime.prefix.disk.writer import Writer
from runtime.prefix.trie import Key, Node, Trie

log = logging.getLogger(__name__)

DEFAULT_QUEUE_BYTES = 1 << 30  # state waiting for the writer
_SPLITTABLE = (KV, ROTATING)  # kinds whose snapshot can be cut short of its end


@dataclass(eq=False)
class _Entry:
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

    def __init__(self, entry: _Entry, layer: int, cut: int | None = None) -> None:
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
        if meta.layout.kind in _SPLITTABLE and meta.floor <= at < self.end and meta.base < at:
            return DiskSnapshot(self.entry, self.layer, at), self
        return None, self

    def __repr__(self) -> str:
        return f"DiskSnapshot({self.entry.name[:8]}, layer {self.layer}, end={self.end})"


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
        self._clock = clock
        self._writer = Writer(queue_bytes)
        # not thread-local: after an engine failure the tier is closed and reopened on
        # another thread, which must see (and release) the same lock
        self._lock = FileLock(str(directory / ".lock"), thread_local=False)
        self._entries: dict[str, _Entry] = {}
        self._bytes = 0
        # what the writer reports to the engine thread: each job's entry and the size
        # written (None: not written); then the entries whose write failed
        self._done: deque[tuple[_Entry, int | None]] = deque()
        self._failed: list[_Entry] = []
        self._dirty = False  # an entry died: its snapshots are still in the trie
        self._counts: Counter[str] = Counter()
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
        self._entries.clear()
        self._settle()
        self._failed.clear()
        self._bytes = 0
        self.closed = False
        return True

    # -- startup --

    def attach(self, trie: Trie) -> None:
        """Index the directory and give the trie a node, with disk snapshots, for each
        usable file (the most recently used file wins a layer two files both hold)."""
        layouts = [layout_of(layer) for layer in trie.layers]
        for tmp in self.directory.glob("*" + TMP_SUFFIX):
            tmp.unlink(missing_ok=True)  # a write that never finished
        found: list[tuple[_Entry, tuple[Key, ...]]] = []
        for path in self.directory.glob("*" + SUFFIX):
            try:
                header, keys = read_header(path, self.identity)
                _check_layouts(header, layouts)
                st = path.stat()
            except (BadEntry, OSError) as exc:
                self._reject(path, str(exc))
                continue
            entry = _Entry(path.name.removesuffix(SUFFIX), header, st.st_size, st.st_mtime)
            found.append((entry, keys))
        found.sort(key=lambda f: (-f[0].last_used, f[0].header.end))
        for entry, _ in found:
            self._entries[entry.name] = entry
            self._bytes += entry.nbytes
        self._shrink()
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
                len(self._entries), self._bytes / 1e6, self.directory,
            )  # fmt: skip

    # -- memory -> disk --

    def spill(self, trie: Trie, node: Node, *, block: bool = False) -> None:
        """Move the node's in-memory snapshots to disk: back to the file they came from,
        to a file that already holds them, or to a new one (dropped when the writer's
        queue is full and not `block`, or when the file could never fit)."""
        fresh: list[tuple[int, ArraySnapshot]] = []
        for i, snap in enumerate(node.snapshots):
            if snap is None or isinstance(snap, DiskSnapshot):
                continue
            source = snap.source if isinstance(snap, ArraySnapshot) else None
            if isinstance(source, DiskSnapshot) and not source.closed and _same(source, snap):
                self._touch(source.entry)
                _move(trie, node, i, source)
            elif isinstance(snap, ArraySnapshot):
                fresh.append((i, snap))
            else:
                _move(trie, node, i, None)  # no codec for it: dropped, as without a disk
        if not fresh:
            return
        try:
            plan = self._plan_write(node, fresh)
        except Exception:
            log.exception("prefix cache: could not page %s out to disk", node)
            plan = None
        if plan is None:
            for i, _ in fresh:
                _move(trie, node, i, None)
            return
        entry, job = plan
        if job is None:
            self._touch(entry)  # the same state is on disk (or queued) already
        elif not self._writer.submit(entry.nbytes, job, block=block):
            self._counts["dropped"] += 1
            for i, _ in fresh:
                _move(trie, node, i, None)
            return
        else:
            self._entries[entry.name] = entry
            self._bytes += entry.nbytes
            self._counts["writes"] += 1
        for i, _ in fresh:
            _move(trie, node, i, DiskSnapshot(entry, i))
        self._shrink(keep=entry)

    def _plan_write(
        self, node: Node, fresh: list[tuple[int, ArraySnapshot]]
    ) -> tuple[_Entry, Callable[[], None] | None] | None:
        """The entry for these snapshots (an existing one holding the same state, or a new
        one holding their arrays, and the job that writes it); None when they cannot go
        to disk."""
        encoded: dict[int, Encoded] = {}
        for i, snap in fresh:
            enc = encode(snap)
            if enc is None:
                return None
            encoded[i] = enc
        metas = {
            i: LayerMeta(
                enc.layout, enc.base, enc.floor, enc.end,
                tuple(str(a.dtype).removeprefix("mlx.core.") for a in enc.arrays),
                tuple(tuple(a.shape) for a in enc.arrays),
            )
            for i, enc in encoded.items()
        }  # fmt: skip
        tokens, runs = encode_keys(node.prefix_keys(len(node.keys)))
        name = content_name(tokens, runs, metas)
        existing = self._entries.get(name)
        if existing is not None:
            return existing, None
        size = size_bound(tokens, runs, metas)  # exact once written (`_settle`)
        if size > self.max_bytes:
            self._counts["too_big"] += 1
            return None
        pending = {i: list(enc.arrays) for i, enc in encoded.items()}
        mx.eval([a for group in pending.values() for a in group])
        # zero-copy views for the writer: the engine thread hands over, never copies
        views: dict[int, list[np.ndarray]] = {}
        exported: list[mx.array] = []
        for i, group in pending.items():
            pairs = [export(a) for a in group]
            views[i] = [view for view, _ in pairs]
            exported += [bits for _, bits in pairs]
        header = Header(node.end, metas, 0, {})
        entry = _Entry(name, header, size, self._clock(), pending=pending, exported=exported)
        return entry, self._job(entry, tokens, runs, [views])

    def _job(
        self,
        entry: _Entry,
        tokens: np.ndarray,
        runs: list[list[Any]],
        holder: list[dict[int, list[np.ndarray]]],
    ) -> Callable[[], None]:
        """The writer's job for `entry`; `holder` has the only references to its numpy
        views, dropped before the engine thread hears the job is done."""
        path = self.directory / (entry.name + SUFFIX)

        def write() -> None:
            views = holder.pop()
            size: int | None = None
            try:
                if not entry.dead:  # else deleted before its turn came
                    entry.header, size = write_entry(
                        path, self.identity, entry.header, tokens, runs, views
                    )
            except Exception as exc:
                log.warning("prefix cache: writing %s failed (%s); dropping it", path.name, exc)
                path.unlink(missing_ok=True)
            finally:
                del views
                self._done.append((entry, size))

        return write

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
                self._reject(self.directory / (entry.name + SUFFIX), str(exc), entry)
                ok = False
                continue
            for (node, i, disk), snap in zip(items, made, strict=True):
                snap.source = disk
                trie.replace_snapshot(node, i, snap)
            self._touch(entry)
        return ok

    def _read(
        self, trie: Trie, entry: _Entry, items: list[tuple[Node, int, DiskSnapshot]]
    ) -> list[ArraySnapshot]:
        layers = sorted({i for _, i, _ in items})
        pending = entry.pending
        if pending is not None:  # not written yet: the snapshots' own arrays
            arrays = {i: pending[i] for i in layers}
        else:
            path = self.directory / (entry.name + SUFFIX)
            began = time.perf_counter()
            arrays = read_layers(path, self.identity, entry.header, layers)
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
                snap: Snapshot | None = decode(meta.layout, meta.base, meta.floor, meta.end, group)
                if disk.cut is not None and snap is not None:
                    snap, rest = trie.layers[i].split(snap, disk.cut)
                    if rest is not None:
                        rest.close()
                if not isinstance(snap, ArraySnapshot) or not _same(disk, snap):
                    raise ValueError(f"layer {i} cannot be cut at {disk.end}")
                made.append(snap)
        except ValueError:
            for snap in made:
                snap.close()
            raise
        return made

    # -- the LRU, deletions --

    def _touch(self, entry: _Entry) -> None:
        now = self._clock()
        entry.last_used = now
        path = self.directory / (entry.name + SUFFIX)

        def touch() -> None:
            if not entry.dead and path.exists():
                with contextlib.suppress(OSError):
                    os.utime(path, (now, now))  # recency survives a restart

        self._writer.submit(0, touch, block=False)

    def _shrink(self, keep: _Entry | None = None) -> None:
        """Delete least recently used files (the deepest first among equals) until the
        directory fits `max_bytes`."""
        if self._bytes <= self.max_bytes:
            return
        order = sorted(
            (e for e in self._entries.values() if e is not keep),
            key=lambda e: (e.last_used, -e.header.end),
        )
        for entry in order:
            if self._bytes <= self.max_bytes:
                break
            self._counts["evictions"] += 1
            self._delete(entry)

    def _delete(self, entry: _Entry) -> None:
        if entry.dead:
            return
        entry.dead = True
        self._dirty = True
        if self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
            self._bytes -= entry.nbytes
        path = self.directory / (entry.name + SUFFIX)
        self._writer.submit(0, lambda: path.unlink(missing_ok=True), block=True)

    def _reject(self, path: Path, why: str, entry: _Entry | None = None) -> None:
        """One warning, then the file goes: it is never loaded into a model."""
        log.warning("prefix cache: skipping and deleting %s: %s", path.name, why)
        self._counts["bad_files"] += 1
        if entry is not None:
            self._delete(entry)
        else:
            path.unlink(missing_ok=True)

    def sweep(self, trie: Trie) -> bool:
        """Drop the snapshots of deleted or failed files from the trie; True when any
        went (their nodes may now be prunable)."""
        self._settle()
        failed, self._failed = self._failed, []
        for entry in failed:
            self._delete(entry)
        if not self._dirty:
            return False
        self._dirty = False
        for node in trie.walk():
            for i, snap in enumerate(node.snapshots):
                if isinstance(snap, DiskSnapshot) and snap.closed:
                    trie.replace_snapshot(node, i, None)
                    node.evicted = True
        return True

    def _settle(self) -> None:
        """Take in what the writer reports: release the arrays of written entries (here,
        on the MLX thread), put real sizes in place of the (upper) estimates, and note
        failed writes for `sweep`."""
        while self._done:
            entry, size = self._done.popleft()
            entry.pending = entry.exported = None
            if size is None:
                if not entry.dead:
                    self._failed.append(entry)
            elif self._entries.get(entry.name) is entry:
                self._bytes += size - entry.nbytes
                entry.nbytes = size
        self._shrink()  # only when a file outgrew its estimate

    # -- lifecycle, inspection --

    def flush(self) -> None:
        """Wait until every queued write and deletion is done."""
        self._writer.flush()
        self._settle()

    def close(self) -> None:
        """Finish the writes, then give the directory up (the lock)."""
        if self.closed:
            return
        self._writer.stop()
        self._settle()
        self.closed = True
        self._lock.release()

    def stats(self) -> dict[str, int]:
        return {
            "disk_entries": len(self._entries),
            "disk_bytes": self._bytes,
            "disk_budget_bytes": self.max_bytes,
            **{f"disk_{k}": self._counts[k] for k in _COUNTS},
        }

    def verify(self) -> None:
        if self._bytes > self.max_bytes:
            raise AssertionError(f"{self._bytes} bytes on disk, budget {self.max_bytes}")
        if self._bytes != sum(e.nbytes for e in self._entries.values()):
            raise AssertionError("disk byte count disagrees with the entries")


_COUNTS = (
    "writes",
    "loads",
    "loaded_bytes",
    "load_us",
    "evictions",
    "dropped",
    "too_big",
    "bad_files",
)


def _same(disk: DiskSnapshot, snap: Snapshot) -> bool:
    return (disk.base, disk.floor, disk.end) == (snap.base, snap.floor, snap.end)


def _move(trie: Trie, node: Node, layer: int, snap: Snapshot | None) -> None:
    """Put `snap` in the layer's place and close the in-memory snapshot it replaces."""
    old = trie.replace_snapshot(node, layer, snap)
    if old is not None and old is not snap and not isinstance(old, DiskSnapshot):
        old.close()


def _check_layouts(header: Header, layouts: Sequence[Layout | None]) -> None:
    for i, meta in header.layers.items():
        if not 0 <= i < len(layouts) or layouts[i] != meta.layout:
            raise BadEntry(f"layer {i} does not fit this model's caches")
