"""Marker scanning with partial-marker hold-back: the engine under every parser.

A `Machine` owns a small text buffer that only ever holds the tail of the input that
could still grow into a marker, so each `feed` does work proportional to its input.
Subclasses are state machines: per state they name the markers to look for, and get
the text between markers and the markers themselves as callbacks.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod


class Markers:
    """A fixed set of literal markers, found in one regex pass over the text."""

    def __init__(self, *markers: str) -> None:
        # Longest first, so that at one position the longest marker wins.
        ordered = sorted({m for m in markers if m}, key=len, reverse=True)
        self.markers: tuple[str, ...] = tuple(ordered)
        pattern = "|".join(re.escape(m) for m in ordered)
        self._re = re.compile(pattern) if ordered else None
        self._prefixes = {m[:k] for m in ordered for k in range(1, len(m))}
        self._starts = {m[0] for m in ordered}
        self._longest = max((len(m) for m in ordered), default=0)

    def search(self, text: str, pos: int) -> tuple[int, str] | None:
        """The earliest marker at or after `pos`, as (start, marker)."""
        if self._re is None:
            return None
        hit = self._re.search(text, pos)
        return (hit.start(), hit.group()) if hit else None

    def partial_len(self, text: str, pos: int) -> int:
        """Length of the longest tail of text[pos:] that is a proper prefix of a marker."""
        end = len(text)
        for k in range(min(self._longest - 1, end - pos), 0, -1):
            if text[end - k] in self._starts and text[end - k :] in self._prefixes:
                return k
        return 0


NO_MARKERS = Markers()


class Machine(ABC):
    """Splits a stream at the markers of the current state and dispatches the pieces.

    `_on_text` returns how many characters it consumed; fewer than it was given means
    its state changed and the rest is scanned again under the new state's markers
    (as is the marker that ended the text, if the state's markers changed). Each
    state's `_markers` must return the same object every time.
    """

    def __init__(self) -> None:
        self._held = ""

    @abstractmethod
    def _markers(self) -> Markers: ...

    @abstractmethod
    def _on_text(self, text: str) -> int: ...

    @abstractmethod
    def _on_marker(self, marker: str) -> None: ...

    def _run(self, text: str, final: bool = False) -> None:
        buf = self._held + text
        pos = 0
        while True:
            markers = self._markers()
            hit = markers.search(buf, pos)
            if hit is not None:
                limit = hit[0]
            else:
                limit = len(buf) if final else len(buf) - markers.partial_len(buf, pos)
            if limit > pos:
                used = self._on_text(buf[pos:limit])
                pos += used
                if pos < limit or self._markers() is not markers:
                    continue  # the state changed: rescan under its markers
            if hit is None:
                break
            pos = hit[0] + len(hit[1])
            self._on_marker(hit[1])
        self._held = buf[pos:]
