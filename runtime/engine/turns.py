"""Turns on the cores between a server's engines: chat models' steps come first, an
encoder's work (embeddings, rerank scores) runs in the time they leave it.

Every engine has its thread, and MLX's CPU work for each runs on all cores (BLAS threads,
the kernels' pool), so two engines computing at once slow each other down far more than
they share: a 1,000-input embedding request took a chat stream's decode from 54 to 18
tokens/s. With `Turns`, the two never compute at once while a chat model has work:

- a foreground engine (a chat model's ModelRunner) calls `before_step` and `after_step`
  around each step (a decode step, a prompt chunk). It is busy from its first step until
  a step leaves it idle;
- a background engine (an EncoderRunner) runs each slice of its work (one layer of a
  piece of inputs) inside `background()`. While no foreground engine is busy a slice
  starts at once. While one is, the slice waits for a turn: at a step boundary the
  foreground engine lets its own queued work finish (`sync`), hands the turn over,
  and waits until the slice ends.

Turns are paced by credit: each foreground step earns the background `share / (1 -
share)` of the step's duration, each slice spends its own, and a turn is handed over once
the credit reaches `grain_s` or one step's worth, whichever is more (`slice_seconds`: how
long a slice should be). A hand-off costs the foreground the overlap of its pipelined
steps, so a few steps' credit make one slice. A slice longer than the credit leaves a
debt, repaid by the steps after it, so the foreground keeps at least `1 - share` of the
time whatever the slices' sizes. A background slice waits at most `patience_s` for a turn
(a foreground engine that stopped stepping never blocks it for good).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

DEFAULT_SHARE = 0.25  # the background's share of the time while a foreground engine works
DEFAULT_GRAIN_S = 0.02  # a chat stream's token now and then comes this much later
DEFAULT_PATIENCE_S = 2.0
_WAKE_S = 0.05  # a foreground engine waiting on a slice re-checks this often
_ROUNDING = 1.0 - 1e-9  # credit summed from steps that make up exactly a slice


@dataclass
class Turn:
    """One background slice: `contended` when a foreground engine was busy (the slice ran
    in its turn, or after `patience_s` without one)."""

    contended: bool


class Turns:
    """See the module docstring. Members are named by any hashable (a runner's id)."""

    def __init__(
        self,
        share: float = DEFAULT_SHARE,
        grain_s: float = DEFAULT_GRAIN_S,
        patience_s: float = DEFAULT_PATIENCE_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 0.0 < share < 1.0:  # 1 would starve no one: then take no turns (None)
            raise ValueError(f"share must be above 0 and below 1, got {share}")
        self.ratio = share / (1.0 - share)  # background seconds per foreground second
        self.grain_s = grain_s
        self.patience_s = patience_s
        self._clock = clock
        self._cond = threading.Condition()
        self._busy: set[object] = set()  # foreground members with work
        self._began: dict[object, float] = {}  # member -> when its step began
        self._credit = 0.0  # seconds of background work the foreground steps allow now
        self._step_seconds = 0.0  # running average of a foreground step
        self._wanted = 0  # background slices waiting for a turn
        self._granted = 0  # turns handed over, not yet taken
        self._running = 0  # background slices computing
        self.handoffs = 0  # turns handed over (for tests and the admin view)

    # -- the foreground side --

    def before_step(self, member: object, sync: Callable[[], None]) -> None:
        """`member` is about to step: a running slice ends first; a waiting slice with
        credit gets its turn now (after `sync` lets the member's queued work finish)."""
        with self._cond:
            self._busy.add(member)
            self._cond.wait_for(lambda: self._running == 0)
            hand = self._wanted > self._granted and self._credit >= self._slice() * _ROUNDING
        if hand:
            sync()  # the member's pipelined step computes no more beside the slice
            with self._cond:
                self._granted += 1
                self.handoffs += 1
                self._cond.notify_all()
                while (self._granted and self._wanted) or self._running:
                    self._cond.wait(_WAKE_S)
                self._granted = 0  # a turn the slice gave up waiting for
        with self._cond:
            self._began[member] = self._clock()

    def after_step(self, member: object, busy: bool) -> None:
        """`member` stepped; `busy`: it has work left (else it is idle until its next step)."""
        now = self._clock()
        with self._cond:
            took = max(0.0, now - self._began.pop(member, now))
            if self._step_seconds == 0.0:
                self._step_seconds = took
            self._step_seconds += (took - self._step_seconds) * 0.2
            if busy:
                self._busy.add(member)
                cap = max(self.ratio * took, self._slice())
                self._credit = min(self._credit + self.ratio * took, cap)
            else:
                self._busy.discard(member)
                if not self._busy:
                    self._credit = 0.0
            self._cond.notify_all()

    def leave(self, member: object) -> None:
        """`member` is idle for good (its batch aborted, its engine stopped)."""
        self.after_step(member, busy=False)

    # -- the background side --

    @property
    def contended(self) -> bool:
        """A foreground engine has work: background slices take turns."""
        return bool(self._busy)

    def slice_seconds(self) -> float | None:
        """How long a background slice should take (the credit a turn is handed over
        with); None while no foreground engine is busy (any length)."""
        with self._cond:
            return self._slice() if self._busy else None

    def _slice(self) -> float:
        return max(self.grain_s, self.ratio * self._step_seconds)

    @contextmanager
    def background(self) -> Iterator[Turn]:
        """Run one background slice inside: at once while no foreground engine is busy,
        else in a turn one hands over (or after `patience_s` without one)."""
        with self._cond:
            turn = Turn(contended=bool(self._busy))
            if turn.contended:
                self._wanted += 1
                deadline = self._clock() + self.patience_s
                while self._busy and not self._granted:
                    left = deadline - self._clock()
                    if left <= 0.0:
                        break
                    self._cond.wait(left)
                self._wanted -= 1
                if self._granted:
                    self._granted -= 1
            self._running += 1
        started = self._clock()
        try:
            yield turn
        finally:
            took = self._clock() - started
            with self._cond:
                self._running -= 1
                if turn.contended and self._busy:
                    self._credit -= took
                self._cond.notify_all()
