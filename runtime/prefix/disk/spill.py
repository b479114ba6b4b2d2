"""The disk tier's writer side: memory -> disk.

`spill` turns a node's in-memory snapshots into disk snapshots: back to the file they
came from, to a file that already holds them, or to a new entry. For a new one the
engine thread evaluates the arrays and hands zero-copy numpy views of them to the
writer thread (runtime/prefix/disk/writer.py), which writes the file
(runtime/prefix/disk/files.py). The arrays stay referenced until the engine thread hears
the write is done (`settle`), and are freed there. When the queue is full the state is
dropped, as it was before the disk tier; `close` waits instead.

A failed write drops its entry and is logged once per kind of failure (later ones are
only counted). A full disk (ENOSPC, EDQUOT) lowers the tier's budget to the files it
holds, so that from then on least recently used files make room for new ones on the
space there is.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from runtime.cache import ArraySnapshot, Snapshot, codec
from runtime.prefix.disk.entry import DiskSnapshot, Entry, same_range
from runtime.prefix.disk.files import (
    Header,
    LayerMeta,
    content_name,
    encode_keys,
    export,
    size_bound,
    write_entry,
)
from runtime.prefix.disk.index import DiskIndex
from runtime.prefix.disk.writer import Writer
from runtime.prefix.trie import Node, Trie

# the tier's one logger: its warnings name the tier, whichever part of it speaks
log = logging.getLogger("runtime.prefix.disk.tier")


class Spiller:
    """Moves snapshots to disk and takes in, on the engine thread, what the writer did."""

    def __init__(
        self, index: DiskIndex, writer: Writer, counts: Counter[str], clock: Callable[[], float]
    ) -> None:
        self._index = index
        self._writer = writer
        self._counts = counts
        self._clock = clock
        # what the writer reports to the engine thread: each job's entry and the size
        # written, or why not (the error, and whether the disk was full; None: deleted
        # before its turn); then the entries whose write failed, and the kinds of
        # failure already logged
        self._done: deque[tuple[Entry, int | tuple[Exception, bool] | None]] = deque()
        self.failed: list[Entry] = []
        self._logged: set[str] = set()

    def spill(self, trie: Trie, node: Node, *, block: bool = False) -> None:
        """Move the node's in-memory snapshots to disk (dropped when the writer's queue
        is full and not `block`, or when the file could never fit)."""
        fresh: list[tuple[int, ArraySnapshot]] = []
        for i, snap in enumerate(node.snapshots):
            if snap is None or isinstance(snap, DiskSnapshot):
                continue
            source = snap.source if isinstance(snap, ArraySnapshot) else None
            if isinstance(source, DiskSnapshot) and not source.closed and same_range(source, snap):
                self._index.touch(source.entry)
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
            self._index.touch(entry)  # the same state is on disk (or queued) already
        else:
            # deletions queue ahead of the write: on a full disk they make its room
            self._index.shrink(room=entry.nbytes)
            if not self._writer.submit(entry.nbytes, job, block=block):
                self._counts["dropped"] += 1
                for i, _ in fresh:
                    _move(trie, node, i, None)
                return
            self._index.add(entry)
            self._counts["writes"] += 1
        for i, _ in fresh:
            _move(trie, node, i, DiskSnapshot(entry, i))
        self._index.shrink(keep=entry)

    def _plan_write(
        self, node: Node, fresh: list[tuple[int, ArraySnapshot]]
    ) -> tuple[Entry, Callable[[], None] | None] | None:
        """The entry for these snapshots (an existing one holding the same state, or a new
        one holding their arrays, and the job that writes it); None when they cannot go
        to disk."""
        encoded: dict[int, codec.Encoded] = {}
        for i, snap in fresh:
            enc = codec.encode(snap)
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
        existing = self._index.entries.get(name)
        if existing is not None:
            return existing, None
        size = size_bound(tokens, runs, metas)  # exact once written (`settle`)
        if size > self._index.max_bytes:
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
        entry = Entry(name, header, size, self._clock(), pending=pending, exported=exported)
        return entry, self._job(entry, tokens, runs, [views])

    def _job(
        self,
        entry: Entry,
        tokens: np.ndarray,
        runs: list[list[Any]],
        holder: list[dict[int, list[np.ndarray]]],
    ) -> Callable[[], None]:
        """The writer's job for `entry`; `holder` has the only references to its numpy
        views, dropped before the engine thread hears the job is done."""
        path = self._index.path(entry)
        identity = self._index.identity

        def write() -> None:
            views = holder.pop()
            outcome: int | tuple[Exception, bool] | None = None
            try:
                if not entry.dead:  # else deleted before its turn came
                    entry.header, outcome = write_entry(
                        path, identity, entry.header, tokens, runs, views
                    )
            except Exception as exc:
                outcome = (exc, _full(exc, path.parent, entry.nbytes))
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
            finally:
                del views
                self._done.append((entry, outcome))

        return write

    def settle(self) -> None:
        """Take in what the writer reports: release the arrays of written entries (here,
        on the MLX thread), put real sizes in place of the (upper) estimates, and note
        failed writes in `failed`."""
        while self._done:
            entry, outcome = self._done.popleft()
            entry.pending = entry.exported = None
            if isinstance(outcome, int):
                self._index.resize(entry, outcome)
                continue
            if not entry.dead:
                self.failed.append(entry)
            if outcome is not None:
                self._write_failed(entry, *outcome)
        self._index.shrink()  # when a file outgrew its estimate, or the disk filled up

    def _write_failed(self, entry: Entry, exc: Exception, full: bool) -> None:
        """Count a failed write and log the first of its kind; on a full disk, lower
        the budget to the files written so far."""
        self._counts["write_errors"] += 1
        kind = "full" if full else type(exc).__name__ + str(getattr(exc, "errno", ""))
        if full:
            written = sum(
                e.nbytes
                for e in self._index.entries.values()
                if e.pending is None and e is not entry and not e.dead
            )
            self._index.max_bytes = min(self._index.max_bytes, written)
        if kind in self._logged:
            return
        self._logged.add(kind)
        where = self._index.directory
        if full:
            log.warning(
                "prefix cache: the disk holding %s is full (%s); the disk tier now keeps "
                "at most the %.1f MB it has written, least recently used files making room",
                where, exc, self._index.max_bytes / 1e6,
            )  # fmt: skip
        else:
            log.warning(
                "prefix cache: writing to %s failed (%s); the entry is dropped, and later "
                "failures like this one are only counted (disk_write_errors)",
                where, exc,
            )  # fmt: skip


def _full(exc: Exception, directory: Path, nbytes: int) -> bool:
    """Whether a write failed for want of space: its error says so (safetensors reports
    one as a SafetensorError, not an OSError), or the file system has less room left
    than the file needs."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        fs = os.statvfs(directory)
    except OSError:
        return False
    return fs.f_bavail * fs.f_frsize < nbytes


def _move(trie: Trie, node: Node, layer: int, snap: Snapshot | None) -> None:
    """Put `snap` in the layer's place and close the in-memory snapshot it replaces."""
    old = trie.replace_snapshot(node, layer, snap)
    if old is not None and old is not snap and not isinstance(old, DiskSnapshot):
        old.close()
