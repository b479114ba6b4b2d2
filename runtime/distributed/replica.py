"""The pieces every rank of a lockstep group runs in place of a single process's: the
scheduler and prefix cache that take rank 0's decisions, requests as the ranks see them,
and a rank's state digest (see runtime/distributed/lockstep.py for the design).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import mlx.core as mx
import numpy as np

from runtime.batch import (
    FUSED_SHARE,
    RequestHandle,
    Scheduler,
    Seq,
    Speculation,
    ThreadSink,
    keeps_on_the_way,
)
from runtime.cache import LayerCache
from runtime.prefix import Node, Plan, PrefixCache, plan_restore
from runtime.text import Sampler, SampleResult
from runtime.types import Finished, GenerationEvent, GenerationRequest, SamplingParams

C = TypeVar("C", bound=LayerCache)
WireRequest = dict[str, Any]  # a request in a round's JSON (see `wire`)
# flags in, for each whether it holds on every rank (an all_sum: a collective)
Agree = Callable[[Sequence[bool]], list[bool]]

# Before a decode step was measured, it counts as a forward of this many prompt tokens:
# generous (on a CPU BLAS one decode step costs what a few prompt tokens do)
_DECODE_AS_TOKENS = 64


class Diverged(RuntimeError):
    """This rank's state no longer matches rank 0's: a bug, never a user's error."""


class Replica(RequestHandle):
    """A request as a lockstep rank's scheduler sees it. Its cancel flag changes only
    between steps (rank 0 freezes it for each step, so every rank reads the same value);
    on rank 0 its events go to the client's handle (`real`), elsewhere nowhere."""

    def __init__(self, serial: int, request: GenerationRequest, real: RequestHandle | None):
        super().__init__(request, ThreadSink())  # the sink is never used: see emit
        self.serial = serial
        self.real = real
        self.frozen = False  # cancelled, as of this step

    @property
    def cancelled(self) -> bool:
        return self.frozen

    def emit(self, event: GenerationEvent) -> None:
        if self.real is not None:
            self.real.emit(event)


def wire(serial: int, request: GenerationRequest, max_tokens: int) -> WireRequest:
    """What a follower needs of a request: the model side only (no sampling: the tokens
    are rank 0's; no grammar; no images: a group refuses them)."""
    return {
        "serial": serial,
        "prompt": list(request.prompt_tokens),
        "max_tokens": max_tokens,
        "stop": list(request.stop_strings),
        "stop_ids": list(request.stop_token_ids),
        "chunk": request.prefill_chunk,
        "boundaries": list(request.boundaries),
    }


def unwire(item: WireRequest) -> tuple[int, GenerationRequest, int]:
    """(serial, request, max_tokens) from `wire`'s form."""
    request = GenerationRequest(
        prompt_tokens=tuple(int(t) for t in item["prompt"]),
        max_tokens=int(item["max_tokens"]),
        sampling=SamplingParams(temperature=0.0),
        stop_strings=tuple(str(s) for s in item["stop"]),
        stop_token_ids=tuple(int(t) for t in item["stop_ids"]),
        prefill_chunk=None if item["chunk"] is None else int(item["chunk"]),
        boundaries=tuple(int(b) for b in item["boundaries"]),
    )
    return int(item["serial"]), request, int(item["max_tokens"])


class Placeholder(Sampler):
    """A follower's sampler. The token is rank 0's (LockstepScheduler._agree); this gives a
    zero that depends on the logits, so that on every rank the step's forward, with its
    collectives, is queued before the collective that carries the token."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(SamplingParams(temperature=0.0), vocab_size, ())

    def sample(self, logits: mx.array, mask: mx.array | None = None) -> SampleResult:
        zero = (mx.argmax(logits.reshape(1, -1), axis=-1) * 0).astype(mx.int32)
        return SampleResult(token=zero, logprob=mx.zeros((1,), dtype=mx.float32))


class LockstepScheduler(Scheduler):
    """The scheduler, with rank 0's timings (`rates`, set before every step) and its
    sampled tokens (`share`, an all_sum over the group). Pipeline stages hold different
    layers, so whether a prefill chunk may ride on a decode step (every layer a token
    cache) and whether every layer rewinds (the trie's snapshot points) are agreed by the
    group (`agree`) at the first step, when every rank is there; so is whether prefill
    chunks go past snapshot points (every rank's layers keep their states there)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a stage holds some of the layers: prompts go through whole, in token chunks
        self.layered = False
        # ranks would have to agree on every draft and acceptance: not drafted here
        self.speculation = Speculation(allowed=False)
        self.rates = (0.0, 0.0)  # rank 0's (decode step seconds, prefill tokens/s)
        self.share: Callable[[mx.array], mx.array] | None = None
        self.agree: Agree | None = None
        self._agreed = False

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        if self.agree is not None and not self._agreed:
            # before the first admission: the trie's snapshot points depend on it
            trie = cast(LockstepPrefixCache[Any], self.prefix)
            own = [self._fuse, trie.own_rewindable(), trie.own_keeps()]
            self._fuse, trie.rewindable, self.keeps_inside = self.agree(own)
            self._agreed = True
        return super().step()

    def _rates(self) -> tuple[float, float]:
        return self.rates

    def held_bytes(self) -> int:
        """The cache memory this rank holds: the running batch's and the trie's."""
        return self.running.nbytes + self.prefix.paged_bytes

    def _agree(self, rows: list[Seq]) -> None:
        if not rows or self.share is None:
            return
        results = [r.unread for r in rows if r.unread is not None]
        assert len(results) == len(rows)
        tokens = [u.token for u in results]
        mx.async_eval(tokens)  # the forward and its collectives first, on every rank
        shared = self.share(mx.concatenate(tokens))
        for i, (row, result) in enumerate(zip(rows, results, strict=True)):
            row.unread = dataclasses.replace(result, token=shared[i : i + 1])

    # -- rank 0's side --

    def measured(self) -> tuple[float, float]:
        """This rank's own timings (rank 0 sends its)."""
        return self.pacing.decode_step_seconds, self.pacing.prefill_rate

    @property
    def row_bytes(self) -> tuple[int, int]:
        return self.running.row_bytes

    @row_bytes.setter
    def row_bytes(self, value: tuple[int, int]) -> None:
        # a follower takes rank 0's, so that whether a new sequence fits is one decision
        self.running.row_bytes = value

    def expected_seconds(self) -> float | None:
        """About how long the next step takes, from this rank's measurements; None when a
        prefill chunk is due whose speed was never measured."""
        step, rate = self.measured()
        seconds = 0.0
        if self._queue:
            if rate <= 0:
                return None
            head = self._queue[0]
            done = 0 if head.prefill is None else head.prefill.offset
            left = len(head.request.prompt_tokens) - done
            seconds += min(head.request.prefill_chunk or self.prefill_chunk, left) / rate
        if self.running.rows:
            if step <= 0:
                if rate <= 0:
                    return None
                step = _DECODE_AS_TOKENS / rate
            seconds += step * (1 + FUSED_SHARE)
        return seconds

    def digest_parts(self) -> list[int]:
        """Numbers every rank must agree on after a step."""
        s = self.stats
        waiting = len(self._trie.writebacks)
        parts = [len(self.running), len(self._queue), waiting, s.steps, s.fused_steps]
        for row in self.running.rows:
            generated = row.out.progress.generated
            parts += [len(generated), generated[-1] if generated else -1]
        for seq in self._queue:
            parts.append(-1 if seq.prefill is None else seq.prefill.offset)
        return parts


class LockstepPrefixCache(PrefixCache[C]):
    """The prefix cache, evicting only between steps: rank 0 decides (`decide_evictions`,
    its own bytes against its own limit) and names its victims; the other ranks evict the
    same nodes (`replay_evictions`). Between those points nothing is evicted, so every
    rank's trie changes the same way.

    A pipeline stage's caches are its layers' only, and what a prefix can be restored
    from, and whether prefill pauses for snapshots, depend on the kinds of cache (a
    stage of attention layers rewinds anywhere, a recurrent one only to its snapshots).
    With `agree` set, the ranks agree on the deepest offset every rank's layers reach,
    where a restore is planned, and on whether a leaf may grow (no rank's snapshot pins
    its end); whether every rank's layers rewind is agreed once, at the scheduler's
    first step (`rewindable`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deciding = False
        self._victims: list[list[int]] = []
        self.agree: Agree | None = None
        self.rewindable: bool | None = None  # every rank's layers, once agreed

    def lend(self, source: Any) -> bool:
        """Never: a rank whose layers are all plain KV caches would lend and take back
        when another does not, and the ranks' restores (and their collectives) part."""
        return False

    def _plan(
        self, path: list[Node], matched: int, live: int, use_disk: bool
    ) -> tuple[int, list[Plan]]:
        if self.agree is None:
            return super()._plan(path, matched, live, use_disk)
        # the offsets the planner tries (prefix_plan.plan_restore): the same on every
        # rank, since every rank's trie has the same nodes and live path
        candidates = sorted({0, matched, live, *(n.end for n in path if n.end < matched)})
        reached = [self._reaches(path, t, live, use_disk) for t in candidates]
        everyone = self.agree(reached)
        target = max(t for t, ok in zip(candidates, everyone, strict=True) if ok)
        planned, plans = plan_restore(self._caches, path, target, min(live, target), use_disk)
        if planned != target:
            raise Diverged(f"the group agreed on offset {target}; this rank reaches {planned}")
        return target, plans

    def _reaches(self, path: list[Node], target: int, live: int, use_disk: bool) -> bool:
        """Whether every layer here reaches `target` (the planner's deepest try, with
        nothing past `target` to try)."""
        return plan_restore(self._caches, path, target, min(live, target), use_disk)[0] == target

    def _pinned(self, leaf: Node) -> bool:
        if self.agree is None:
            return super()._pinned(leaf)
        # asked of a childless leaf only, which every rank's trie has alike: a collective
        # at the same point on every rank
        (bare,) = self.agree([not leaf.has_snapshots()])
        return not bare

    def own_rewindable(self) -> bool:
        """Whether this rank's layers rewind anywhere."""
        return super()._all_rewindable()

    def own_keeps(self) -> bool:
        """Whether this rank's layers give their states at points a chunk went past."""
        return keeps_on_the_way(self._caches)

    def _all_rewindable(self) -> bool:
        return self.own_rewindable() if self.rewindable is None else self.rewindable

    def _evict_over_budget(self, active: set[int]) -> None:
        if self._deciding:
            super()._evict_over_budget(active)

    def _pick_victim(self, active: set[int], pinned: set[int]) -> Any:
        node = super()._pick_victim(active, pinned)
        if node is not None and self._deciding:
            index = next(i for i, n in enumerate(self._trie.walk()) if n is node)
            self._victims.append([index, node.end])
        return node

    def decide_evictions(self) -> list[list[int]]:
        """Rank 0, between steps: evict to the limit; the victims as [walk index, end]."""
        if not self.enabled:
            return []
        self._deciding, self._victims = True, []
        try:
            self._enforce_budget()
        finally:
            self._deciding = False
        return self._victims

    def digest_parts(self) -> list[int]:
        """Numbers every rank's trie must agree on, cheap enough for every round (no walk
        of the trie; never bytes: shards differ)."""
        keys = ("requests", "hits", "reused_tokens", "adopted", "discards", "evictions")
        return [*(self._counts[k] for k in keys), len(self._path), self._path[-1].end]

    def replay_evictions(self, victims: Sequence[Sequence[int]]) -> None:
        """A follower, between steps: evict what rank 0 did, in its order."""
        if not self.enabled:
            return
        active = {id(n) for n in self._path}
        for index, end in victims:
            nodes = list(self._trie.walk())
            if not 0 <= index < len(nodes) or nodes[index].end != end:
                raise Diverged(f"rank 0 evicted node {index} (ending at {end}): no such node here")
            self._evict(nodes[index], active)
            self._counts["evictions"] += 1
        self._prune(active)


def _crc(data: bytes) -> int:
    """A digest: cheap, and the same on every host."""
    return zlib.crc32(data)


def share_over(group: mx.distributed.Group) -> Callable[[mx.array], mx.array]:
    """Rank 0's tokens on every rank: the others hold zeros (Placeholder)."""

    def share(tokens: mx.array) -> mx.array:
        return mx.distributed.all_sum(tokens, group=group)

    return share


class GroupMemory:
    """The cache memory the group's schedulers work to, so that the rank holding the
    most stays within the budget. Every rank holds the same tokens, but in shares that
    differ (uneven head splits; pipeline stages whose layers' caches differ in kind, a
    sliding window's against a full one's): rank 0 decides by its own bytes, so it works
    to the budget scaled by its own share of the largest rank's, as last reported."""

    MIN_HELD = 1 << 20  # below this, a ratio says little: the last one stands

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.ratio = 1.0  # the largest rank's bytes over rank 0's

    def update(self, held: Sequence[int]) -> int:
        """The memory to work to, given each rank's bytes (rank 0's first)."""
        if held and held[0] >= self.MIN_HELD:
            self.ratio = max(1.0, max(held) / held[0])
        return int(self.budget / self.ratio)


def agree_over(group: mx.distributed.Group) -> Agree:
    """`Agree` over `group`: one all_sum of the flags, read back at once."""
    size = int(group.size())

    def agree(flags: Sequence[bool]) -> list[bool]:
        summed = mx.distributed.all_sum(mx.array([int(f) for f in flags], mx.int32), group=group)
        mx.eval(summed)
        counts = cast(list[int], summed.tolist())
        return [count == size for count in counts]

    return agree


def state_digest(scheduler: LockstepScheduler, prefix: LockstepPrefixCache[Any]) -> int:
    """A digest of what every rank's step changes alike."""
    parts = [*scheduler.digest_parts(), *prefix.digest_parts()]
    return _crc(np.asarray(parts, np.int64).tobytes()) & 0x7FFFFFFF


def fingerprint(config: dict[str, Any], context_length: int, eos: frozenset[int]) -> int:
    """Which model a rank loaded (its config, context and end ids): every rank must agree."""
    text = json.dumps([config, context_length, sorted(eos)], sort_keys=True, default=str)
    return _crc(text.encode()) & 0x7FFFFFFF
