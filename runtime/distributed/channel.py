"""The control channel of a lockstep group: rank 0's decisions reach every rank over
mx.distributed itself, before the step that depends on them, and every rank's heartbeat
comes back in the same collective.

One exchange ("round") is an `all_sum` of a fixed-size int32 header: rank 0 writes the
command and its step inputs, every rank writes its own slot (that it is there, how many
rounds it has seen, a digest of its state, the cache memory it holds), zeros elsewhere,
so the sum is everyone's words. When rank 0 has more to say (admissions, cancellations, evictions) a second
`all_sum` carries that many bytes of JSON from rank 0, zeros elsewhere. Both run on the
caller's stream, after whatever it queued: every rank issues the same collectives in the
same order, the only thing that keeps a collective group from mixing messages.

Collectives can block forever: the ring backend hangs when a peer dies while a
collective is queued, and any backend does when a host freezes or its link drops without
a reset. A `Watchdog` thread bounds each blocking stretch (a round, or a round and the
step after it) and calls its `expired` callback when one runs over; the blocked thread
itself cannot be freed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

VERSION = 1
_HEAD = 16  # header words before the per-rank slots
_SLOT = 4  # words per rank: present, rounds seen, digest, cache memory held (KiB)
# header words
_VERSION, _COMMAND, _ROUND, _PAYLOAD = 0, 1, 2, 3
_RATES = 4  # two float64: decode step seconds, prefill tokens/s (two words each)
_ROW_BYTES = 8  # two int64: bytes per token, per row of the running batch
_BOUND_MS = 12  # how long the coming step may take, in milliseconds
_MEMORY = 13  # one int64: the cache memory every rank's scheduler works to, in bytes
_KIB_MAX = 2**31 - 1


class Command(IntEnum):
    HELLO = 1  # the handshake: settings out, model fingerprints back
    STEP = 2  # apply the inputs, then one scheduler step
    IDLE = 3  # a heartbeat (and any inputs) while rank 0 has nothing to run
    ABORT = 4  # end every sequence (shutdown, or a failed worker)
    CLOSE = 5  # end every sequence and drop every cached state
    STOP = 6  # leave: rank 0 is done (payload "stop": why, when it is a failure)


class GroupLost(RuntimeError):
    """The group cannot go on: a rank left, stopped answering, or its state diverged."""


@dataclass(frozen=True)
class Round:
    """What rank 0 says in one exchange (every rank sees the same)."""

    command: Command
    payload: dict[str, Any] = field(default_factory=dict)
    rates: tuple[float, float] = (0.0, 0.0)
    row_bytes: tuple[int, int] = (0, 0)
    bound: float = 0.0  # seconds the step after this round may take
    memory: int = 0  # the cache memory the coming step works to (0: as it was)


@dataclass(frozen=True)
class Heard:
    """One exchange's result: rank 0's round and every rank's slot."""

    round: Round
    number: int  # rounds rank 0 has sent, this one included
    present: tuple[bool, ...]
    seen: tuple[int, ...]  # rounds each rank had completed before this one
    digests: tuple[int, ...]  # each rank's state digest, as it reported
    held: tuple[int, ...] = ()  # each rank's cache memory in bytes (to the KiB)


class Channel:
    """Exchanges rounds over `group` (see the module docstring); one thread at a time."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.size = int(group.size())
        self.rounds = 0  # rounds completed here

    def send(self, message: Round, digest: int, held: int = 0) -> Heard:
        """Rank 0: say `message`; hear every rank's slot."""
        assert self.rank == 0, "only rank 0 sends"
        payload = _encode(message.payload)
        head = self._header(digest, held)
        head[_VERSION] = VERSION
        head[_COMMAND] = int(message.command)
        head[_ROUND] = self.rounds + 1
        head[_PAYLOAD] = len(payload)
        head[_RATES : _RATES + 4] = np.array(message.rates, np.float64).view(np.int32)
        head[_ROW_BYTES : _ROW_BYTES + 4] = np.array(message.row_bytes, np.int64).view(np.int32)
        head[_BOUND_MS] = min(int(message.bound * 1000), 2**31 - 1)
        head[_MEMORY : _MEMORY + 2] = np.array([message.memory], np.int64).view(np.int32)
        return self._exchange(head, payload)

    def receive(self, digest: int, held: int = 0) -> Heard:
        """A follower: hear rank 0's next round, reporting `digest` and the cache
        memory it holds (`held` bytes)."""
        assert self.rank != 0, "rank 0 sends"
        return self._exchange(self._header(digest, held), None)

    def _header(self, digest: int, held: int) -> np.ndarray:
        head = np.zeros(_HEAD + _SLOT * self.size, np.int32)
        mine = _HEAD + _SLOT * self.rank
        kib = min(max(0, held) // 1024, _KIB_MAX)
        head[mine : mine + 4] = (1, self.rounds, digest & 0x7FFFFFFF, kib)
        return head

    def _exchange(self, head: np.ndarray, payload: bytes | None) -> Heard:
        summed = self._all_sum(head)
        if int(summed[_VERSION]) != VERSION:
            raise GroupLost(
                f"rank 0 speaks lockstep version {int(summed[_VERSION])}, this rank "
                f"{VERSION}: run the same mlx-gateway on every host"
            )
        length = int(summed[_PAYLOAD])
        data = b""
        if length:
            mine = payload if payload is not None else bytes(length)
            data = self._all_sum(np.frombuffer(mine, np.uint8)).tobytes()
        slots = summed[_HEAD:].reshape(self.size, _SLOT)
        absent = [str(r) for r in range(self.size) if not slots[r, 0]]
        if absent:  # its part of the sum never came: its link failed, not a round heard
            raise GroupLost(
                f"rank {', '.join(absent)} left the group (no part in round "
                f"{int(summed[_ROUND])}: its connection failed)"
            )
        self.rounds += 1
        message = Round(
            command=Command(int(summed[_COMMAND])),
            payload=json.loads(data) if data else {},
            rates=_floats(summed[_RATES : _RATES + 4]),
            row_bytes=_ints(summed[_ROW_BYTES : _ROW_BYTES + 4]),
            bound=int(summed[_BOUND_MS]) / 1000,
            memory=int(np.ascontiguousarray(summed[_MEMORY : _MEMORY + 2]).view(np.int64)[0]),
        )
        return Heard(
            round=message,
            number=int(summed[_ROUND]),
            present=tuple(bool(s[0]) for s in slots),
            seen=tuple(int(s[1]) for s in slots),
            digests=tuple(int(s[2]) for s in slots),
            held=tuple(int(s[3]) * 1024 for s in slots),
        )

    def _all_sum(self, values: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(values), group=self.group)
        mx.eval(out)
        return np.array(out, copy=True)


def _encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode() if payload else b""


def _floats(words: np.ndarray) -> tuple[float, float]:
    a, b = np.ascontiguousarray(words, np.int32).view(np.float64).tolist()
    return float(a), float(b)


def _ints(words: np.ndarray) -> tuple[int, int]:
    a, b = np.ascontiguousarray(words, np.int32).view(np.int64).tolist()
    return int(a), int(b)


class Watchdog:
    """Bounds blocking stretches: `arm(seconds, what)` before one, `disarm()` after; a
    stretch that runs over calls `expired(what, seconds)` once, from the watchdog's thread."""

    def __init__(self, expired: Callable[[str, float], None], *, name: str) -> None:
        self._expired = expired
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        self._bound = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._started = False

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def arm(self, seconds: float, what: str) -> None:
        with self._lock:
            self._deadline = time.monotonic() + seconds
            self._what, self._bound = what, seconds

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    @property
    def deadline(self) -> float | None:
        """When (time.monotonic) the armed stretch runs over; None while disarmed."""
        with self._lock:
            return self._deadline

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what, bound = self._what, self._bound
                if late:
                    self._deadline = None
            if late:
                try:
                    self._expired(what, bound)
                except Exception:  # the watchdog outlives what it reports to
                    log.exception("lockstep watchdog callback failed")
