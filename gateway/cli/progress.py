"""Byte progress for long copies (model fetches) on stderr, drawn by tqdm.

On a terminal tqdm redraws one line in place (bytes done / total, percent, rate, time
left), as huggingface_hub's own bars for Hub downloads do; when the stream is not a
terminal (logs, CI, pytest capture) the bar stays off and one summary line is written when
the step ends, so logs get one line per step instead of hundreds.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TextIO

from tqdm import tqdm


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
        self, label: str, total: int, *, stream: TextIO, interactive: bool | None = None
    ) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._stream = stream
        self._interactive = is_interactive(stream) if interactive is None else interactive
        self._start = time.monotonic()
        self._closed = False
        self._bar = tqdm(
            desc=label,
            total=total,
            file=stream,
            disable=not self._interactive,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            leave=True,
        )

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
        self._bar.update(n)

    def close(self, *, ok: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._bar.close()
        if not self._interactive and ok:
            elapsed = max(time.monotonic() - self._start, 1e-9)
            self._stream.write(
                f"{self.label}: {format_bytes(self.done)} in {elapsed:.1f} s "
                f"({format_bytes(self.done / elapsed)}/s)\n"
            )
        self._stream.flush()
