"""A small byte-progress bar for long copies (model fetches), written to stderr.

On a terminal it redraws one line in place (bytes done / total, percent, MB/s); when the
stream is not a terminal (logs, CI, pytest capture) it stays quiet and writes one summary
line when the step ends, so logs get one line per step instead of hundreds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

_BAR_WIDTH = 24
_REDRAW_INTERVAL_S = 0.1


def format_bytes(n: float) -> str:
    """Decimal units, as pip and package indexes show sizes."""
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def note(stream: TextIO, message: str) -> None:
    """One status line (a step started or ended); always written, tty or not."""
    stream.write(message + "\n")
    stream.flush()


def is_interactive(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:  # a closed stream
        return False


class Progress:
    """Counts bytes towards a known total; use as a context manager around the copy loop."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        stream: TextIO,
        interactive: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._stream = stream
        self._interactive = is_interactive(stream) if interactive is None else interactive
        self._clock = clock
        self._start = clock()
        self._last_draw = float("-inf")
        self._closed = False
        self._drawn = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(ok=exc_type is None)

    def update(self, n: int) -> None:
        self.done += n
        if not self._interactive:
            return
        now = self._clock()
        if now - self._last_draw >= _REDRAW_INTERVAL_S or self.done >= self.total:
            self._last_draw = now
            self._draw(self._line(now))
            self._stream.flush()

    def close(self, *, ok: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        now = self._clock()
        if self._interactive:
            # Final redraw so the line shows the end state, then leave it on screen.
            self._draw(self._line(now))
            self._stream.write("\n")
        elif ok:
            elapsed = max(now - self._start, 1e-9)
            self._stream.write(
                f"{self.label}: {format_bytes(self.done)} in {elapsed:.1f} s "
                f"({format_bytes(self.done / elapsed)}/s)\n"
            )
        self._stream.flush()

    def _draw(self, line: str) -> None:
        # Pad to the previous width: "\r" alone leaves the tail of a longer earlier line.
        self._stream.write("\r" + line.ljust(self._drawn))
        self._drawn = len(line)

    def _line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        fraction = min(self.done / self.total, 1.0) if self.total > 0 else 1.0
        filled = int(fraction * _BAR_WIDTH)
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        return (
            f"{self.label} [{bar}] {format_bytes(self.done)}/{format_bytes(self.total)} "
            f"{fraction * 100:5.1f}% {format_bytes(self.done / elapsed)}/s"
        )
