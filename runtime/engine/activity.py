"""What a model's engine is doing now, for the admin view (gateway/admin/state.py): the
running batch row by row, the requests that ended lately, and who to tell when that
changes.

The engine's thread writes it: the runner calls `admitted` when it takes a request in,
`began` when a prompt leases the prefix trie, and `publish` after every step. `view` is
a frozen `ActivityView` replaced whole, so any thread may read it. It is replaced, and
the listeners called, when the rows change (a request queued, started its prompt, joined
the batch or ended) or the runner says the trie changed; progress alone (tokens decoded)
refreshes it at most every `refresh_s`, without a call. A listener runs on the engine's
thread: it hands the news on (asyncio's call_soon_threadsafe) and never blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.prefix import CacheReport, Key
from runtime.types import Finished

if TYPE_CHECKING:
    from runtime.batch import RequestHandle, Scheduler, Seq, SequenceOutput
    from runtime.prefix import Lease

log = logging.getLogger(__name__)

RECENT = 32  # ended requests kept
KEPT_KEYS = 1 << 18  # prompt keys kept over them (their paths in the trie); older ones drop
REFRESH_S = 0.5


@dataclass(frozen=True)
class RowView:
    """One request the scheduler holds: `queued` (admitted, its prompt not started),
    `prefill` (its prompt being read) or `decode` (a row of the running batch)."""

    id: int  # this engine's number for the request, from 1
    phase: str
    prompt_tokens: int
    cached_tokens: int | None  # reused from the prefix trie (None until its prompt starts)
    prefilled_tokens: int  # prompt tokens in its caches
    generated_tokens: int
    max_tokens: int
    age_seconds: float  # since it was submitted
    ttft_seconds: float | None  # submitted to first token
    tokens_per_second: float | None  # prompt tokens read (prefill) or generated (decode)
    cache: CacheReport | None
    drafted_tokens: int = 0  # speculative decoding: drafted and checked
    accepted_tokens: int = 0  # of those, written


@dataclass(frozen=True)
class RequestRecord:
    """A request that ended."""

    id: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    error: str | None
    ttft_seconds: float | None
    tokens_per_second: float  # decode
    prefill_tokens_per_second: float
    ended_at: float  # wall clock
    cache: CacheReport | None
    keys: tuple[Key, ...]  # prompt and output as the trie keys them; () once dropped
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class ActivityView:
    version: int  # grows with every replacement
    rows: tuple[RowView, ...]  # prefill queue first, then the running batch
    recent: tuple[RequestRecord, ...]  # oldest first
    batch_bytes: int  # the running batch's caches now
    batch_projected_bytes: int  # with every row at its longest (what admission counts)


@dataclass(eq=False)
class _Entry:
    id: int
    handle: RequestHandle
    out: SequenceOutput
    prefill_at: float | None = None  # when its prompt started


class Activity:
    """See the module docstring."""

    def __init__(
        self,
        recent: int = RECENT,
        kept_keys: int = KEPT_KEYS,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.view = ActivityView(0, (), (), 0, 0)
        self._kept_keys = kept_keys
        self._refresh_s = refresh_s
        self._clock = clock
        self._entries: dict[RequestHandle, _Entry] = {}
        self._keys: dict[int, tuple[Key, ...]] = {}  # a lease's keys until its request ends
        self._recent: collections.deque[RequestRecord] = collections.deque(maxlen=recent)
        self._serial = 0
        self._shape: tuple[tuple[int, str], ...] = ()
        self._published = 0.0
        self._listeners: list[Callable[[], None]] = []
        self._listeners_lock = threading.Lock()

    # -- readers ---------------------------------------------------------------------
    def listen(self, callback: Callable[[], None]) -> None:
        with self._listeners_lock:
            self._listeners.append(callback)

    def unlisten(self, callback: Callable[[], None]) -> None:
        with self._listeners_lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def notify(self) -> None:
        with self._listeners_lock:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback()
            except Exception:  # a listener's failure must never reach the engine
                log.exception("an activity listener failed")

    # -- the engine's thread ------------------------------------------------------------
    def admitted(self, handle: RequestHandle, out: SequenceOutput) -> None:
        self._serial += 1
        self._entries[handle] = _Entry(self._serial, handle, out)

    def began(self, lease: Lease[Any]) -> None:
        self._keys[lease.serial] = lease.tokens
        while len(self._keys) > 4 * RECENT:  # leases whose request never ended here
            del self._keys[next(iter(self._keys))]

    def publish(
        self,
        scheduler: Scheduler,
        ended: Iterable[tuple[RequestHandle, Finished]] = (),
        *,
        changed: bool = False,
    ) -> None:
        """After a step (or an admission, an abort): file the requests that `ended`,
        and replace the view if the rows changed (or `changed`: the trie did), or every
        `refresh_s` while something runs."""
        now = self._clock()
        for handle, done in ended:
            entry = self._entries.pop(handle, None)
            if entry is not None:
                self._file(entry, done)
                changed = True
        seqs = [(s, "queued" if s.prefill is None else "prefill") for s in scheduler.waiting()]
        seqs += [(s, "decode") for s in scheduler.running.rows]
        shape = tuple((self._id(s), phase) for s, phase in seqs)
        changed = changed or shape != self._shape
        if not changed and (not seqs or now - self._published < self._refresh_s):
            return
        self._shape, self._published = shape, now
        rows = [self._row(s, phase, now) for s, phase in seqs]
        self.view = ActivityView(
            self.view.version + 1,
            tuple(r for r in rows if r is not None),
            tuple(self._recent),
            scheduler.running.nbytes,
            scheduler.running.projected(),
        )
        if changed:
            self.notify()

    def clear(self) -> None:
        """The runner closed: no request is held any more."""
        self._entries.clear()
        self._keys.clear()

    def _id(self, seq: Seq) -> int:
        entry = self._entries.get(seq.handle)
        return 0 if entry is None else entry.id

    def _row(self, seq: Seq, phase: str, now: float) -> RowView | None:
        entry = self._entries.get(seq.handle)
        if entry is None:
            return None
        p, submitted = seq.out.progress, seq.handle.submitted_at
        prefill = seq.prefill
        rate = None
        if phase == "prefill" and prefill is not None:
            entry.prefill_at = entry.prefill_at or now
            done = prefill.offset - p.reused
            rate = done / (now - entry.prefill_at) if now > entry.prefill_at else None
        elif phase == "decode" and p.first_at is not None and len(p.generated) > 1:
            rate = (len(p.generated) - 1) / max(now - p.first_at, 1e-9)
        if phase == "decode":
            prefilled = len(p.prompt)
        else:
            prefilled = prefill.offset if prefill is not None else 0
        return RowView(
            id=entry.id,
            phase=phase,
            prompt_tokens=len(p.prompt),
            cached_tokens=None if p.cache is None else p.reused,
            prefilled_tokens=prefilled,
            generated_tokens=len(p.generated),
            max_tokens=seq.out.max_tokens,
            age_seconds=now - submitted,
            ttft_seconds=None if p.first_at is None else p.first_at - submitted,
            tokens_per_second=rate,
            cache=p.cache,
            drafted_tokens=seq.drafts.drafted,
            accepted_tokens=seq.drafts.accepted,
        )

    def _file(self, entry: _Entry, done: Finished) -> None:
        p, stats = entry.out.progress, done.stats
        keys: tuple[Key, ...] = ()
        if p.cache is not None:
            keys = self._keys.pop(p.cache.serial, ())
            keys = keys + tuple(p.generated) if keys else ()
        submitted = entry.handle.submitted_at
        self._recent.append(
            RequestRecord(
                id=entry.id,
                prompt_tokens=stats.prompt_tokens,
                cached_tokens=stats.cached_tokens,
                completion_tokens=stats.completion_tokens,
                finish_reason=done.reason.value,
                error=done.error,
                ttft_seconds=None if p.first_at is None else p.first_at - submitted,
                tokens_per_second=stats.decode_tps,
                prefill_tokens_per_second=stats.prefill_tps,
                ended_at=time.time(),
                cache=p.cache,
                keys=keys,
                drafted_tokens=stats.drafted_tokens,
                accepted_tokens=stats.accepted_tokens,
            )
        )
        self._bound_keys()

    def _bound_keys(self) -> None:
        """Drop the oldest records' keys while all of them hold more than `kept_keys`."""
        total = sum(len(r.keys) for r in self._recent)
        for i, record in enumerate(self._recent):
            if total <= self._kept_keys:
                return
            if record.keys:
                total -= len(record.keys)
                self._recent[i] = dataclasses.replace(record, keys=())
