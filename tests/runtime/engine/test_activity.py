"""The engine's published activity (runtime/engine/activity.py): rows by phase, the view
replaced and the listeners called when the rows change, progress refreshed without a call,
ended requests filed with their trie keys (bounded)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from runtime.batch.drafts import DraftCounts
from runtime.engine import Activity
from runtime.prefix import CacheReport, MissReason
from runtime.types import Finished, FinishReason, GenerationStats


class Handle:  # hashable by identity, as RequestHandle is
    submitted_at = 0.0


class Clock:
    now = 1.0

    def __call__(self) -> float:
        return self.now


def seq(prompt: int = 6) -> Any:
    progress = SimpleNamespace(
        prompt=tuple(range(prompt)), reused=0, generated=[], first_at=None, cache=None
    )
    return SimpleNamespace(handle=Handle(), out=SimpleNamespace(progress=progress, max_tokens=9),
                           prefill=None, drafts=DraftCounts(drafted=4, accepted=3))  # fmt: skip


class Scheduler:
    def __init__(self) -> None:
        self.queue: list[Any] = []
        self.running = SimpleNamespace(rows=[], nbytes=100, projected=lambda: 400)

    def waiting(self) -> tuple[Any, ...]:
        return tuple(self.queue)


def test_rows_follow_the_phases_and_wake_the_listeners() -> None:
    clock, calls = Clock(), []
    activity = Activity(refresh_s=0.5, clock=clock)
    activity.listen(lambda: calls.append(activity.view.version))
    sched, s = Scheduler(), seq()
    sched.queue.append(s)
    activity.admitted(s.handle, s.out)
    activity.publish(sched)  # type: ignore[arg-type]
    assert [(r.id, r.phase) for r in activity.view.rows] == [(1, "queued")] and calls == [1]
    assert activity.view.batch_bytes == 100 and activity.view.batch_projected_bytes == 400

    activity.publish(sched)  # type: ignore[arg-type]  # nothing changed, too soon to refresh
    assert activity.view.version == 1
    clock.now += 0.6
    activity.publish(sched)  # type: ignore[arg-type]  # a refresh: no call
    assert activity.view.version == 2 and calls == [1]

    report = CacheReport(7, 6, 2, 2, MissReason.DIVERGED, 2)
    lease = SimpleNamespace(serial=7, tokens=tuple(range(6)))
    activity.began(lease)  # type: ignore[arg-type]
    s.out.progress.cache, s.out.progress.reused = report, 2
    s.prefill = SimpleNamespace(offset=2)
    activity.publish(sched)  # type: ignore[arg-type]
    clock.now += 1.0
    s.prefill.offset = 4
    activity.publish(sched)  # type: ignore[arg-type]
    (row,) = activity.view.rows
    assert row.phase == "prefill" and row.cached_tokens == 2 and row.prefilled_tokens == 4
    assert row.tokens_per_second == 2.0 and calls == [1, 3]  # 2 tokens read in 1 s

    sched.queue.clear()
    s.prefill = None
    sched.running.rows.append(s)
    s.out.progress.generated, s.out.progress.first_at = [50, 51, 52], clock.now
    clock.now += 0.5
    activity.publish(sched)  # type: ignore[arg-type]
    (row,) = activity.view.rows
    assert row.phase == "decode" and row.prefilled_tokens == 6 and row.tokens_per_second == 4.0
    assert (row.drafted_tokens, row.accepted_tokens) == (4, 3)  # speculative decoding's

    sched.running.rows.clear()
    stats = GenerationStats(6, 3, cached_tokens=2, prefill_seconds=1.0, decode_seconds=0.5)
    activity.publish(sched, [(s.handle, Finished(FinishReason.STOP, stats))])  # type: ignore[arg-type]
    (record,) = activity.view.recent
    assert activity.view.rows == () and calls[-1] == activity.view.version
    assert record.keys == (0, 1, 2, 3, 4, 5, 50, 51, 52) and record.cache is report
    assert record.finish_reason == "stop" and record.tokens_per_second == 4.0


def test_older_records_drop_their_keys_first() -> None:
    activity = Activity(kept_keys=10, clock=Clock())
    sched = Scheduler()
    for serial in (1, 2):
        s = seq(prompt=6)
        activity.admitted(s.handle, s.out)
        activity.began(SimpleNamespace(serial=serial, tokens=s.out.progress.prompt))  # type: ignore[arg-type]
        s.out.progress.cache = CacheReport(serial, 6, 0, 0, MissReason.NEW, 0)
        done = Finished(FinishReason.STOP, GenerationStats(6, 0))
        activity.publish(sched, [(s.handle, done)])  # type: ignore[arg-type]
    first, second = activity.view.recent
    assert first.keys == () and len(second.keys) == 6
