"""The disk tier's index: what is in its directory, an `Entry` per file by content name,
with each file's size and recency.

The directory is kept under `max_bytes` by deleting the least recently used files (the
deepest first among equals); a deleted entry is marked dead and `dirty` is set, so the
tier drops its snapshots from the trie on its next sweep. File operations (deleting,
touching) go through the writer thread (runtime/prefix/disk/writer.py), in order after
the writes queued before them. A bad file gets one warning and is deleted: it is never
loaded into a model.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from runtime.cache import codec
from runtime.prefix.disk.entry import Entry
from runtime.prefix.disk.files import SUFFIX, TMP_SUFFIX, BadEntry, Header, read_header
from runtime.prefix.disk.writer import Writer
from runtime.prefix.trie import Key

# the tier's one logger: its warnings name the tier, whichever part of it speaks
log = logging.getLogger("runtime.prefix.disk.tier")


class DiskIndex:
    """The catalogue of the directory's files, kept within `max_bytes`."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        identity: str,
        writer: Writer,
        counts: Counter[str],
        clock: Callable[[], float],
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.identity = identity
        self.entries: dict[str, Entry] = {}
        self.nbytes = 0
        self.dirty = False  # an entry died: its snapshots are still in the trie
        self._writer = writer
        self._counts = counts
        self._clock = clock

    def path(self, entry: Entry) -> Path:
        return self.directory / (entry.name + SUFFIX)

    def clear(self) -> None:
        """Forget every entry (the directory is read again on `scan`)."""
        self.entries.clear()
        self.nbytes = 0

    def scan(self, layouts: Sequence[codec.Layout | None]) -> list[tuple[Entry, tuple[Key, ...]]]:
        """Index the directory's usable files, most recently used first, with each one's
        keys; then shrink to the bound (the entries it deleted come back dead)."""
        for tmp in self.directory.glob("*" + TMP_SUFFIX):
            tmp.unlink(missing_ok=True)  # a write that never finished
        found: list[tuple[Entry, tuple[Key, ...]]] = []
        for path in self.directory.glob("*" + SUFFIX):
            try:
                header, keys = read_header(path, self.identity)
                _check_layouts(header, layouts)
                st = path.stat()
            except (BadEntry, OSError) as exc:
                self.reject(path, str(exc))
                continue
            entry = Entry(path.name.removesuffix(SUFFIX), header, st.st_size, st.st_mtime)
            found.append((entry, keys))
        found.sort(key=lambda f: (-f[0].last_used, f[0].header.end))
        for entry, _ in found:
            self.add(entry)
        self.shrink()
        return found

    def add(self, entry: Entry) -> None:
        self.entries[entry.name] = entry
        self.nbytes += entry.nbytes

    def resize(self, entry: Entry, size: int) -> None:
        """The real size of a written file, in place of the (upper) estimate."""
        if self.entries.get(entry.name) is entry:
            self.nbytes += size - entry.nbytes
            entry.nbytes = size

    def touch(self, entry: Entry) -> None:
        now = self._clock()
        entry.last_used = now
        path = self.path(entry)

        def touch() -> None:
            if not entry.dead and path.exists():
                with contextlib.suppress(OSError):
                    os.utime(path, (now, now))  # recency survives a restart

        self._writer.submit(0, touch, block=False)

    def shrink(self, keep: Entry | None = None, room: int = 0) -> None:
        """Delete least recently used files (the deepest first among equals) until the
        directory fits `max_bytes`, with `room` bytes to spare."""
        if self.nbytes + room <= self.max_bytes:
            return
        order = sorted(
            (e for e in self.entries.values() if e is not keep),
            key=lambda e: (e.last_used, -e.header.end),
        )
        for entry in order:
            if self.nbytes + room <= self.max_bytes:
                break
            self._counts["evictions"] += 1
            self.delete(entry)

    def delete(self, entry: Entry) -> None:
        if entry.dead:
            return
        entry.dead = True
        self.dirty = True
        if self.entries.get(entry.name) is entry:
            del self.entries[entry.name]
            self.nbytes -= entry.nbytes
        path = self.path(entry)
        self._writer.submit(0, lambda: path.unlink(missing_ok=True), block=True)

    def reject(self, path: Path, why: str, entry: Entry | None = None) -> None:
        """One warning, then the file goes: it is never loaded into a model."""
        log.warning("prefix cache: skipping and deleting %s: %s", path.name, why)
        self._counts["bad_files"] += 1
        if entry is not None:
            self.delete(entry)
        else:
            path.unlink(missing_ok=True)

    def verify(self) -> None:
        if self.nbytes > self.max_bytes:
            raise AssertionError(f"{self.nbytes} bytes on disk, budget {self.max_bytes}")
        if self.nbytes != sum(e.nbytes for e in self.entries.values()):
            raise AssertionError("disk byte count disagrees with the entries")


def _check_layouts(header: Header, layouts: Sequence[codec.Layout | None]) -> None:
    for i, meta in header.layers.items():
        if not 0 <= i < len(layouts) or layouts[i] != meta.layout:
            raise BadEntry(f"layer {i} does not fit this model's caches")
