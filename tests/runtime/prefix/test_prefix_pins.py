"""The prefix cache's account of each request (why it reused what it did) and pinned
prompts (kept ahead of others in eviction until their TTL runs out, while the byte
budget allows). Requests run through the same harness as tests/runtime/prefix/test_prefix_cache.py, so
every reply is still checked against the cache-off oracle; pins expire by a clock the
tests move by hand."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.prefix.cache import Key, PrefixCache
from runtime.prefix.report import MissReason
from runtime.types import PrefixPin
from tests.runtime.prefix.test_prefix_cache import (
    BIG,
    KINDS,
    Oracle,
    _cache,
    _clock,
    check_snapshots,
    run_request,
    tracked_snapshots,
)
from tests.support.recurrent_model import HybridModel


@pytest.fixture(scope="module")
def models() -> dict[str, HybridModel]:
    return {name: HybridModel(KINDS[name], window=6, seed=7) for name in ("plain", "recurrent")}


def _reason(pc: PrefixCache[Any]) -> MissReason:
    return pc.recent()[-1].reason


def test_miss_reasons(models: dict[str, HybridModel]) -> None:
    model = models["plain"]
    pc, oracle = _cache(model), Oracle(model)
    a_prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    a = run_request(pc, model, oracle, a_prompt, 2)
    assert _reason(pc) is MissReason.NEW
    run_request(pc, model, oracle, a_prompt, 2)
    assert _reason(pc) is MissReason.HIT
    run_request(pc, model, oracle, [1, 2, 3, 4, 5, 10, 11, 12], 2)
    diverged = pc.recent()[-1]
    assert diverged.reason is MissReason.DIVERGED and (diverged.matched, diverged.reused) == (5, 5)
    # each side of the divergence, as the request and the cache hold them
    assert diverged.before == (1, 2, 3, 4, 5) and diverged.wanted == (10, 11, 12)
    assert diverged.cached[:3] == (6, 7, 8)
    run_request(pc, model, oracle, [*a_prompt, *a.generated, 40, 41], 2)
    extends = pc.recent()[-1]
    assert extends.reason is MissReason.EXTENDS and not extends.cached
    assert extends.reused == len(a_prompt) + len(a.generated) - 1
    assert [r.reason for r in pc.recent()][:2] == [MissReason.NEW, MissReason.HIT]  # oldest first
    decoded = diverged.describe(lambda ids: " ".join(map(str, ids)))
    cached = " ".join(map(str, diverged.cached))  # A's prompt tail, then what A generated
    assert cached.startswith("6 7 8")
    assert decoded["divergence"] == {
        "at": 5, "before": "1 2 3 4 5", "request": "10 11 12", "cached": cached
    }  # fmt: skip
    assert "differs" in str(decoded["detail"]) and decoded["computed"] == 3


def test_recurrent_miss_names_the_restore_point(models: dict[str, HybridModel]) -> None:
    model = models["recurrent"]
    pc, oracle = _cache(model, interval=4), Oracle(model)
    run_request(pc, model, oracle, [1, 2, 3, 4, 5, 6, 7, 8])
    out = run_request(pc, model, oracle, [1, 2, 3, 4, 5, 10, 11, 12])
    why = pc.recent()[-1]
    # matched 5 tokens, but the recurrent layer has state only at snapshot points
    assert why.reason is MissReason.NOT_SNAPSHOTTED and (why.matched, why.reused) == (5, 4)
    assert why.at == out.reused == 4 and "restore point at token 4" in why.detail()
    off = _cache(model, budget=0)
    off.discard(off.begin([1, 2, 3]))
    assert _reason(off) is MissReason.OFF


def _ring(n: int, first: int) -> list[Key]:
    """A 9-token conversation of its own (its first token differs from the others')."""
    return [first, *range(1, n)]


@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_prefix_outlives_newer_unpinned_ones(
    pinned: bool, models: dict[str, HybridModel]
) -> None:
    model = models["plain"]
    now, clock = _clock()
    # each 9-token conversation pages out 2304 bytes here: the budget holds two
    pc = PrefixCache(model.make_caches, budget_bytes=5000, snapshot_interval=4, clock=clock)
    oracle = Oracle(model)
    a = _ring(9, 100)
    run_request(pc, model, oracle, a, 2, pin=PrefixPin(ttl=300) if pinned else None)
    for first in (101, 102, 103, 104):
        run_request(pc, model, oracle, _ring(9, first), 2)
        now[0] += 10
    assert pc.stats()["evictions"] >= 2 and pc.stats()["paged_bytes"] <= 5000
    again = run_request(pc, model, oracle, a, 2)
    if pinned:
        assert again.reused == len(a) - 1 and _reason(pc) is MissReason.HIT
        assert pc.stats()["pinned_evictions"] == 0
    else:  # the oldest went first, and the report knows it was there
        assert again.reused == 0 and _reason(pc) is MissReason.EVICTED


def test_a_pin_expires(models: dict[str, HybridModel]) -> None:
    model = models["plain"]
    now, clock = _clock()
    pc = PrefixCache(model.make_caches, budget_bytes=5000, snapshot_interval=4, clock=clock)
    oracle = Oracle(model)
    a = _ring(9, 100)
    run_request(pc, model, oracle, a, 2, pin=PrefixPin(ttl=60, key="session-1"))
    # the trie holds the whole prompt (and the reply after it)
    pin = {"key": "session-1", "ttl_seconds": 60, "expires_in_seconds": 60.0, "tokens": 9}
    assert pc.pins() == [{**pin, "matched_tokens": 9}]
    run_request(pc, model, oracle, _ring(9, 101), 2)
    now[0] = 61.0  # the pin ran out: A is the least recently used again
    assert pc.pins() == [] and pc.stats()["pins"] == 0
    for first in (102, 103, 104):
        run_request(pc, model, oracle, _ring(9, first), 2)
    assert run_request(pc, model, oracle, a, 2).reused == 0
    assert _reason(pc) is MissReason.EVICTED


def test_pins_over_the_budget_are_evicted_too(
    models: dict[str, HybridModel], caplog: pytest.LogCaptureFixture
) -> None:
    model = models["plain"]
    _, clock = _clock()
    pc = PrefixCache(model.make_caches, budget_bytes=3000, snapshot_interval=4, clock=clock)
    oracle = Oracle(model)
    with tracked_snapshots() as created:
        for first in (100, 101, 102, 103):
            run_request(pc, model, oracle, _ring(9, first), 2, pin=PrefixPin(ttl=3600))
        stats = pc.stats()
        assert stats["pinned_evictions"] >= 2 and stats["paged_bytes"] <= 3000
        assert "evicting pinned state" in caplog.text
        # the most recent pinned conversation is the one kept
        assert run_request(pc, model, oracle, _ring(9, 102), 2).reused == 8
        pc.verify()
        check_snapshots(pc, created)


def test_an_extended_pin_folds_the_shorter_one(models: dict[str, HybridModel]) -> None:
    model = models["plain"]
    now, clock = _clock()
    pc = PrefixCache(model.make_caches, budget_bytes=BIG, snapshot_interval=4, clock=clock)
    oracle = Oracle(model)
    history: list[Key] = [1, 2, 3, 4, 5]
    for turn in range(3):
        out = run_request(pc, model, oracle, history, 2, pin=PrefixPin(ttl=300, key="conv"))
        history = [*history, *out.generated, 20 + turn]
        now[0] += 1
    pins = pc.pins()
    assert len(pins) == 1 and pins[0]["tokens"] == len(history) - 3  # the last turn's prompt
    run_request(pc, model, oracle, [9, 9, 9], 2, pin=PrefixPin(ttl=5))  # another prompt
    assert [p["tokens"] for p in pc.pins()] == [3, len(history) - 3]  # soonest to expire first
