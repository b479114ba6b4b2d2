"""The prefix cache: with greedy decoding, any sequence of requests gives the same tokens
(and the same logits) with the cache on as with it off, while the trie's invariants and
the byte budget hold and no snapshot leaks or is closed twice.

Tests drive the API the runner uses: begin, prefill pausing at the snapshot points,
greedy decode, end (or a cancel midway). Models are tiny random MLX models whose layers
use plain, rotating and recurrent caches (tests/support/recurrent_model.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.cache import ArraySnapshot, KVCache, KVSnapshot, LayerCache
from runtime.models import build_model
from runtime.prefix.cache import ImageKey, Key, Lease, PrefixCache, image_keys
from runtime.prefix.report import MissReason
from runtime.prefix.trie import Trie
from runtime.types import PrefixPin
from tests.support.recurrent_model import FULL, RECURRENT, SLIDING, HybridModel

ATOL = 1e-4
IMAGE_TOKEN = 255  # what the model sees at an image position
BIG = 10**9
KINDS: dict[str, tuple[str, ...]] = {
    "plain": (FULL, FULL),
    "rotating": (SLIDING, FULL),
    "recurrent": (FULL, RECURRENT, SLIDING),
}


class Model(Protocol):
    def forward(self, tokens: mx.array, caches: Sequence[Any]) -> mx.array: ...
    def logits(self, hidden: mx.array) -> mx.array: ...
    def make_caches(self) -> Sequence[LayerCache]: ...


@pytest.fixture(scope="module")
def models() -> dict[str, HybridModel]:
    return {name: HybridModel(kinds, window=6, seed=7) for name, kinds in KINDS.items()}


@pytest.fixture(scope="module")
def oracles(models: dict[str, HybridModel]) -> dict[str, Oracle]:
    """Shared across hypothesis examples, so each prompt runs cache-off once."""
    return {name: Oracle(model) for name, model in models.items()}


# -- running requests --


def _ids(keys: Sequence[Key]) -> list[int]:
    return [k if isinstance(k, int) else IMAGE_TOKEN for k in keys]


def _feed(model: Model, caches: Sequence[Any], keys: Sequence[Key]) -> mx.array:
    hidden = model.forward(mx.array(_ids(keys), dtype=mx.int32)[None], caches)
    mx.eval(hidden, *[a for c in caches for a in c.state])
    return hidden


def _greedy(model: Model, caches: Sequence[Any], last: Key, n: int) -> tuple[np.ndarray, list[int]]:
    """Run the last prompt token, then decode `n` tokens greedily (the last one not fed)."""
    first = np.array(model.logits(_feed(model, caches, [last])[:, -1])[0])
    out = [int(first.argmax())]
    while len(out) < n:
        out.append(int(np.array(model.logits(_feed(model, caches, out[-1:])[:, -1])).argmax()))
    return first, out


class Oracle:
    """Cache-off results, memoised by prompt."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._memo: dict[tuple[Key, ...], tuple[np.ndarray, list[int]]] = {}

    def run(self, prompt: Sequence[Key], n: int) -> tuple[np.ndarray, list[int]]:
        key = tuple(prompt)
        if key not in self._memo or len(self._memo[key][1]) < n:
            caches = self.model.make_caches()
            if len(prompt) > 1:
                _feed(self.model, caches, prompt[:-1])
            self._memo[key] = _greedy(self.model, caches, prompt[-1], max(n, 1))
        first, tokens = self._memo[key]
        return first, tokens[:n]


@dataclass(frozen=True)
class Outcome:
    reused: int
    generated: list[int]
    cancelled: bool


def _prefill(pc: PrefixCache[Any], lease: Lease[Any], model: Model, stop: int, chunk: int) -> None:
    """Feed the prompt from the reused offset to `stop`, pausing at the snapshot points."""
    pos = lease.reused
    for target in sorted({*(p for p in lease.snapshot_points if p <= stop), stop}):
        while pos < target:
            n = min(chunk, target - pos)
            _feed(model, lease.caches, lease.tokens[pos : pos + n])
            pos += n
        if target in lease.snapshot_points:
            pc.snapshot_at(lease, target)
            pc.verify()


def run_request(
    pc: PrefixCache[Any],
    model: Model,
    oracle: Oracle,
    prompt: Sequence[Key],
    max_new: int = 3,
    *,
    chunk: int = 64,
    cancel_at: float | None = None,
    pipelined: bool = False,
    pin: PrefixPin | None = None,
    boundaries: Sequence[int] = (),
) -> Outcome:
    """One request through the cache; checks its logits and tokens against the oracle.

    `cancel_at` cancels during prefill, after that fraction of the tokens to run.
    `pipelined` feeds the last sampled token too, as pipelined decode leaves it.
    """
    lease = pc.begin(prompt, pin=pin, boundaries=boundaries)
    pc.verify()
    assert 0 <= lease.reused < len(prompt)
    why = lease.report
    assert why is not None and why is pc.recent()[-1]
    assert why.reused == lease.reused <= why.matched < len(prompt)
    if why.reason is not MissReason.OFF:
        assert (why.reason is MissReason.HIT) == (lease.reused == why.matched == len(prompt) - 1)
    assert all(c.offset == lease.reused for c in lease.caches)
    last = len(prompt) - 1
    if cancel_at is not None:
        stop = lease.reused + int(cancel_at * (last - lease.reused))
        _prefill(pc, lease, model, stop, chunk)
        pc.end(lease, prompt[:stop])
        return Outcome(lease.reused, [], True)
    _prefill(pc, lease, model, last, chunk)
    first, generated = _greedy(model, lease.caches, prompt[-1], max_new)
    if pipelined:
        _feed(model, lease.caches, generated[-1:])
    want_first, want = oracle.run(prompt, max_new)
    np.testing.assert_allclose(first, want_first, atol=ATOL, rtol=0)
    assert generated == want
    held = lease.caches[0].offset
    pc.end(lease, [*prompt, *generated][:held])
    return Outcome(lease.reused, generated, False)


@contextmanager
def tracked_snapshots() -> Iterator[list[ArraySnapshot]]:
    """Every snapshot created inside the block."""
    created: list[ArraySnapshot] = []
    original = ArraySnapshot.__init__

    def init(self: ArraySnapshot, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        created.append(self)

    ArraySnapshot.__init__ = init  # type: ignore[method-assign]
    try:
        yield created
    finally:
        ArraySnapshot.__init__ = original  # type: ignore[method-assign]


def check_snapshots(pc: PrefixCache[Any], created: list[ArraySnapshot]) -> None:
    """Held by the trie and open, or out of it and closed exactly once."""
    held = {id(s) for s in pc.held_snapshots()}
    for snap in created:
        want = 0 if id(snap) in held else 1
        assert snap.close_count == want, f"{snap} closed {snap.close_count}x (held: {want == 0})"


def _cache(model: Model, budget: int = BIG, interval: int = 4, tail: int = 2) -> PrefixCache[Any]:
    return PrefixCache(
        model.make_caches, budget_bytes=budget, snapshot_interval=interval, tail_keep=tail
    )


# -- scenarios (after seed 003's tests) --


@pytest.mark.parametrize("kind", list(KINDS))
def test_branch_creation_and_reuse(kind: str, models: dict[str, HybridModel]) -> None:
    model = models[kind]
    pc, oracle = _cache(model), Oracle(model)
    with tracked_snapshots() as created:
        a_prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        a = run_request(pc, model, oracle, a_prompt)
        assert a.reused == 0
        b = run_request(pc, model, oracle, [1, 2, 3, 4, 5, 10, 11, 12])
        # recurrent state exists only at snapshot points (every 4 tokens here)
        assert b.reused == {"plain": 5, "rotating": 5, "recurrent": 4}[kind]
        c = run_request(pc, model, oracle, [*a_prompt, *a.generated, 40, 41])
        assert c.reused == len(a_prompt) + len(a.generated) - 1  # A's paged-out leaf
        pc.verify()
        check_snapshots(pc, created)


@pytest.mark.parametrize("kind", list(KINDS))
def test_exact_repeat_reuses_up_to_the_tail(kind: str, models: dict[str, HybridModel]) -> None:
    model = models[kind]
    pc, oracle = _cache(model, interval=1024, tail=2), Oracle(model)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert run_request(pc, model, oracle, prompt, 2).reused == 0
    again = run_request(pc, model, oracle, prompt, 4)
    # the last token always runs; caches that cannot rewind use the prompt-end snapshot
    assert again.reused == {"plain": 8, "rotating": 7, "recurrent": 7}[kind]
    # the second run snapshotted where it left the trie, one token before the end
    assert run_request(pc, model, oracle, prompt, 3).reused == 8


@pytest.mark.parametrize("kind", list(KINDS))
def test_conversation_resumption(kind: str, models: dict[str, HybridModel]) -> None:
    model = models[kind]
    pc, oracle = _cache(model), Oracle(model)
    history: list[Key] = [1, 2, 3, 4, 5]
    for turn in range(3):
        out = run_request(pc, model, oracle, history, 3, pipelined=True)
        if turn:
            assert out.reused == len(history) - 2  # everything but the new user turn
        history = [*history, *out.generated, 20 + turn, 30 + turn]


@pytest.mark.parametrize("kind", list(KINDS))
def test_branch_switch_restores_right_state(kind: str, models: dict[str, HybridModel]) -> None:
    model = models[kind]
    pc, oracle = _cache(model), Oracle(model)
    a = run_request(pc, model, oracle, [1, 2, 3, 4, 5], 2)
    run_request(pc, model, oracle, [1, 2, 3, 6, 7], 2)
    back = run_request(pc, model, oracle, [1, 2, 3, 4, 5, *a.generated, 20], 2)
    assert back.reused == 6
    run_request(pc, model, oracle, [1, 2, 3, 6, 7, 8, 9], 2)
    pc.verify()


@pytest.mark.parametrize("kind", list(KINDS))
def test_eviction_keeps_budget_and_live_conversation(
    kind: str, models: dict[str, HybridModel]
) -> None:
    model = models[kind]
    budget = 3000
    pc, oracle = _cache(model, budget=budget), Oracle(model)
    system = [1, 2, 3, 4, 5, 6, 7]
    with tracked_snapshots() as created:
        outs = [
            run_request(pc, model, oracle, [*system, 100 + i, 101 + i, 102], 2) for i in range(6)
        ]
        assert pc.stats()["evictions"] > 0
        assert pc.stats()["paged_bytes"] <= budget
        last = [*system, 105, 106, 102, outs[-1].generated[0], 9]
        assert run_request(pc, model, oracle, last).reused == len(last) - 1  # the live path
        check_snapshots(pc, created)


def test_restore_failure_drops_to_a_clean_state(
    models: dict[str, HybridModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = models["recurrent"]
    pc, oracle = _cache(model), Oracle(model)
    run_request(pc, model, oracle, [1, 2, 3, 4, 5, 6])
    victim = pc.begin([1]).caches[1]
    pc.discard(pc.begin([1]))
    monkeypatch.setattr(victim, "restore", lambda snapshot, target: False)
    out = run_request(pc, model, oracle, [1, 2, 3, 4, 5, 6, 7, 8])
    assert out.reused == 0 and pc.stats()["restore_failures"] >= 1
    monkeypatch.undo()
    assert run_request(pc, model, oracle, [1, 2, 3, 4, 5, 6, 7, 8, 9]).reused > 0


def test_zero_budget_disables_caching(models: dict[str, HybridModel]) -> None:
    model = models["recurrent"]
    pc, oracle = _cache(model, budget=0), Oracle(model)
    first = pc.begin([1, 2, 3])
    assert first.reused == 0 and first.snapshot_points == ()
    pc.end(first, [])
    for _ in range(2):
        assert run_request(pc, model, oracle, [1, 2, 3, 4]).reused == 0
    assert pc.stats()["nodes"] == 0 and pc.stats()["requests"] == 3
    lease = pc.begin([1, 2])
    assert lease.caches is not pc.begin([1, 2]).caches  # fresh caches every time


def test_image_keys_never_alias(models: dict[str, HybridModel]) -> None:
    token: Key = 0
    assert ImageKey("abc", 0) != token
    assert image_keys("abc", 2) == [ImageKey("abc", 0), ImageKey("abc", 1)]
    model = models["plain"]
    pc, oracle = _cache(model), Oracle(model)
    cat: list[Key] = [1, 2, *image_keys("cat", 3), 5, 6]
    dog: list[Key] = [1, 2, *image_keys("dog", 3), 5, 6]
    run_request(pc, model, oracle, cat)
    assert run_request(pc, model, oracle, dog).reused == 2  # same token ids, other image
    assert run_request(pc, model, oracle, cat).reused == len(cat) - 1


@pytest.mark.parametrize("kind", ["plain", "recurrent"])
def test_end_with_fewer_tokens_than_the_caches_hold(
    kind: str, models: dict[str, HybridModel]
) -> None:
    model = models[kind]
    pc, oracle = _cache(model), Oracle(model)
    prompt = [3, 1, 4, 1, 5, 9]
    lease = pc.begin(prompt)
    _prefill(pc, lease, model, len(prompt), 64)  # all six tokens are in the caches
    pc.end(lease, prompt[:4])
    pc.verify()
    # a plain cache rewinds to what it was told; a recurrent one cannot and starts clean
    assert pc.stats()["live_tokens"] == {"plain": 4, "recurrent": 0}[kind]
    run_request(pc, model, oracle, [*prompt, 2, 6])


def test_discard_and_cancel_leave_usable_state(models: dict[str, HybridModel]) -> None:
    model = models["recurrent"]
    pc, oracle = _cache(model), Oracle(model)
    lease = pc.begin([5, 5, 5, 5, 5, 5, 5])
    _feed(model, lease.caches, [5, 5, 5])
    pc.discard(lease)
    assert pc.stats()["live_tokens"] == 0 and pc.stats()["discards"] == 1
    pc.verify()
    cancelled = run_request(pc, model, oracle, list(range(20, 40)), cancel_at=0.6)
    assert cancelled.cancelled
    assert run_request(pc, model, oracle, list(range(20, 45))).reused >= 8
    with pytest.raises(ValueError):
        pc.end(lease, [])  # a closed lease


def test_snapshot_points(models: dict[str, HybridModel]) -> None:
    rec = PrefixCache(
        models["recurrent"].make_caches, budget_bytes=BIG, snapshot_interval=8, tail_keep=4
    )
    lease = rec.begin(list(range(30)))
    assert lease.snapshot_points == (8, 16, 24, 26)
    with pytest.raises(ValueError, match="not all at offset"):
        rec.snapshot_at(lease, 8)
    rec.discard(lease)
    plain = PrefixCache(models["plain"].make_caches, budget_bytes=BIG, snapshot_interval=8)
    assert plain.begin(list(range(30))).snapshot_points == ()  # KV rewinds anywhere


def test_stats_and_dump(models: dict[str, HybridModel]) -> None:
    model = models["recurrent"]
    pc, oracle = _cache(model), Oracle(model)
    run_request(pc, model, oracle, [1, 2, 3, 4, 5, 6])
    run_request(pc, model, oracle, [1, 2, 3, 4, 7, 8])
    stats = pc.stats()
    assert stats["requests"] == 2 and stats["hits"] == 1 and stats["reused_tokens"] == 4
    assert stats["nodes"] >= 3 and stats["paged_bytes"] > 0
    assert "[0,4)" in pc.dump() and "*" in pc.dump()


_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
}
_GEMMA = {
    **_LLAMA,
    "model_type": "gemma3_text",
    "head_dim": 16,
    "sliding_window": 4,
    "sliding_window_pattern": 2,
    "query_pre_attn_scalar": 16,
}


@pytest.mark.parametrize("config", [_LLAMA, _GEMMA], ids=["llama", "gemma3"])
def test_real_architectures(config: dict[str, Any]) -> None:
    mx.random.seed(3)
    model = build_model(config)
    mx.eval(model.parameters())
    pc = PrefixCache(model.make_caches, budget_bytes=BIG, snapshot_interval=4, tail_keep=2)
    oracle = Oracle(model)
    a = run_request(pc, model, oracle, [1, 2, 3, 4, 5, 6, 7], 3)
    run_request(pc, model, oracle, [1, 2, 3, 9, 9], 3)
    assert run_request(pc, model, oracle, [1, 2, 3, 4, 5, 6, 7, *a.generated, 8]).reused == 9


# -- the trie on its own --


def _kv_layer(n: int, start: int = 0) -> tuple[KVCache, KVSnapshot]:
    cache = KVCache()
    k = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)
    cache.update_and_fetch(mx.zeros((1, 1, start, 1)), mx.zeros((1, 1, start, 1)))
    cache.update_and_fetch(k, k)
    snap = cache.snapshot(start)
    assert snap is not None
    return cache, snap


def test_trie_match_split_and_branch() -> None:
    trie = Trie([KVCache()])
    trie.add_child(trie.root, (1, 2, 3, 4, 5), 0)
    path, matched = trie.match([1, 2, 3, 6, 7])
    assert matched == 3 and path[-1].keys == (1, 2, 3, 4, 5)
    upper = trie.split(path[-1], 3)
    trie.add_child(upper, (6, 7), 0)
    assert trie.match([1, 2, 3, 4, 5])[1] == 5 and trie.match([1, 2, 3, 6, 7])[1] == 5
    assert trie.match([1, 2, 9])[1] == 2 and trie.match([7])[1] == 0
    with pytest.raises(ValueError):
        trie.add_child(upper, (4, 9), 0)  # siblings never share a first key
    added = trie.advance(trie.root, [1, 2, 8, 9], 1)
    assert [n.keys for n in added] == [(1, 2), (8, 9)]
    assert sorted(len(n.children) for n in trie.walk()) == [0, 0, 0, 1, 2, 2]
    trie.verify()


def test_trie_merge_joins_edges_and_snapshots() -> None:
    trie = Trie([KVCache()])
    a = trie.add_child(trie.root, (1, 2, 3), 0)
    b = trie.add_child(a, (4, 5), 5)
    c, d = trie.add_child(b, (6,), 0), trie.add_child(b, (7,), 0)
    _, head = _kv_layer(3)
    _, tail = _kv_layer(2, start=3)
    trie.set_snapshots(a, [head])
    trie.set_snapshots(b, [tail])
    trie.merge_with_child(a)
    assert (a.keys, a.end, a.last_used) == ((1, 2, 3, 4, 5), 5, 5)
    assert c.parent is a and d.parent is a and b.parent is None
    merged = a.snapshot(0)
    assert isinstance(merged, KVSnapshot) and (merged.base, merged.end) == (0, 5)
    assert head.closed and tail.closed and trie.paged_bytes == merged.nbytes
    trie.verify()
    b.end = 99  # a detached node does not matter; a broken live one does
    c.keys = (6, 6)
    with pytest.raises(AssertionError):
        trie.verify()


# -- the invariant, on random workloads --


def _clock() -> tuple[list[float], Any]:
    """A clock the test moves by hand (pins expire by it)."""
    now = [0.0]
    return now, lambda: now[0]


@dataclass(frozen=True)
class Op:
    kind: str  # new | extend | branch | repeat
    conv: int
    tokens: tuple[int, ...]
    cut: float
    max_new: int
    cancel_at: float | None
    pipelined: bool
    chunk: int
    pin: float | None  # a TTL, in ops (the test's clock advances one per op)


_OPS = st.builds(
    Op,
    kind=st.sampled_from(["new", "extend", "extend", "branch", "repeat"]),
    conv=st.integers(0, 7),
    # a small alphabet, so edges often match partly and branch mid-edge
    tokens=st.lists(st.integers(0, 7), min_size=1, max_size=9).map(tuple),
    cut=st.floats(0, 1),
    max_new=st.integers(1, 4),
    cancel_at=st.one_of(st.none(), st.none(), st.none(), st.floats(0, 1)),
    pipelined=st.booleans(),
    chunk=st.sampled_from([2, 5, 64]),
    pin=st.sampled_from([None, None, 1.5, 4.0, 100.0]),
)
_SYSTEM = (1, 2, 3, 4, 5, 6)


def _prompt(op: Op, convs: list[list[Key]], last: list[list[Key]]) -> tuple[list[Key], int | None]:
    """The op's prompt and the conversation it continues (None: a new one)."""
    if op.kind == "new" or not convs:
        return [*_SYSTEM[: op.conv], *op.tokens], None
    i = op.conv % len(convs)
    if op.kind == "extend":
        return [*convs[i], *op.tokens], i
    if op.kind == "branch":
        return [*convs[i][: int(op.cut * len(convs[i]))], *op.tokens], None
    return last[i], i


def _play(
    pc: PrefixCache[Any], model: Model, oracle: Oracle, ops: list[Op], now: list[float]
) -> None:
    convs: list[list[Key]] = []
    last: list[list[Key]] = []
    with tracked_snapshots() as created:
        for op in ops:
            prompt, i = _prompt(op, convs, last)
            pin = None if op.pin is None else PrefixPin(ttl=op.pin)
            out = run_request(
                pc, model, oracle, prompt, op.max_new,
                chunk=op.chunk, cancel_at=op.cancel_at, pipelined=op.pipelined, pin=pin,
            )  # fmt: skip
            now[0] += 1
            pc.verify()
            check_snapshots(pc, created)
            history = prompt if out.cancelled else [*prompt, *out.generated]
            if i is None:
                convs.append(history)
                last.append(prompt)
            elif op.kind == "extend":
                convs[i], last[i] = history, prompt
    stats = pc.stats()
    # planning only picks restores that work, and the runner's tokens always fit
    assert stats["restore_failures"] == 0 and stats["discards"] == 0


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_OPS, min_size=2, max_size=9),
    budget=st.sampled_from([1200, 6000, BIG]),
    interval=st.sampled_from([3, 8, 1024]),
    tail=st.sampled_from([1, 2, 4]),
)
def test_cache_on_equals_cache_off(
    kind: str,
    models: dict[str, HybridModel],
    oracles: dict[str, Oracle],
    ops: list[Op],
    budget: int,
    interval: int,
    tail: int,
) -> None:
    model = models[kind]
    now, clock = _clock()
    pc = PrefixCache(
        model.make_caches,
        budget_bytes=budget,
        snapshot_interval=interval,
        tail_keep=tail,
        clock=clock,
    )
    _play(pc, model, oracles[kind], ops, now)


def test_message_starts_are_restore_points_for_recurrent_layers() -> None:
    """An agent edits its conversation's last message (a reminder in the latest user turn):
    a hybrid model resumes from that message's start, not from the last interval point."""
    model = HybridModel(KINDS["recurrent"], window=6, seed=11)
    first = list(range(1, 31))
    starts = (10, 20, 24)
    edited = [*first[:24], 90, 91, 92, 93]
    for marks, reused in (((), 0), (starts, 24)):
        pc, oracle = _cache(model, interval=1000), Oracle(model)
        run_request(pc, model, oracle, first, 2, boundaries=marks)
        out = run_request(pc, model, oracle, edited, 2, boundaries=marks)
        assert out.reused == reused  # and run_request checked the logits against the oracle
