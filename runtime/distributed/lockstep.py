"""Lockstep serving of one model across a distributed group: rank 0 decides, every rank
steps.

The cut: every rank runs the same `ModelRunner` and `Scheduler` code over the same
requests (a follower's copy of each carries the model side: prompt, output bound, stop
strings, message boundaries), so every rank takes the same steps on identical caches.
The prefix trie is replicated: each rank's trie has the same nodes, and their snapshots
hold that rank's shard of the caches. A scheduler's decisions are a function of its
state and of a few inputs that differ per rank; exactly those are rank 0's, sent in the
round (runtime/distributed/channel.py) that opens each step:

- admissions (which requests join, and when) and cancellations, frozen for the step: a
  client's cancel lands between steps on every rank alike;
- the measured timings that size prefill chunks (decode step seconds, prefill rate) and
  the batch's bytes per token that decide whether a new sequence fits;
- prefix-cache evictions: bytes differ per shard, so no rank evicts on its own; rank 0
  evicts between steps and names its victims, which every rank evicts before the step;
- the cache memory to work to: every rank reports what it holds in each round, and rank
  0 scales the budget by its own share of the largest rank's (replica.GroupMemory), so
  that a rank holding more of the same tokens (uneven head splits, a full-attention
  stage against sliding windows) stays within it;
- sampled tokens: rank 0 samples (its sampler, grammar and seed); the ids reach the other
  ranks inside the step's graph, one `all_sum` of the batch's tokens with zeros on the
  followers, so decoding stays pipelined (runtime/distributed/replica.py).

What follows from the tokens (end of sequence, stop strings, max_tokens, when a row
leaves the batch, what goes back to the trie) every rank derives itself with the same
code, and a digest of each rank's state rides in every round: a rank that drifts stops
the group with a clear error instead of serving garbage. The other cut, followers
replaying a log of rank 0's cache operations, would need a second copy of the
scheduler's and the trie's logic; this one needs a few small hooks (the scheduler's
`_rates` and `_agree`, the trie's `_evict_over_budget`, `_plan` and `_all_rewindable`,
the runner's `*_type`).

Pipeline stages hold different layers, so decisions that depend on the kinds of cache
(which prefix a request restores, where its prefill pauses for snapshots, whether a
chunk rides on a decode step) would differ per rank: the ranks agree on those with a
small all_sum where they are made (replica.py), at the same point of the same step.

Failure: a collective that raises, or a round or step that outruns its bound
(`timeout` plus three times the step's expected time, or `slow_bound` for a prefill
whose speed is unknown), loses the group: rank 0's engine halts (every request gets a
503, /health says why) and the process stays up; a follower exits. Followers answer
every round with a heartbeat; an idle rank 0 sends one each second (`tick`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from runtime.distributed.channel import Channel, Command, GroupLost, Heard, Round, Watchdog
from runtime.distributed.replica import (
    GroupMemory,
    LockstepPrefixCache,
    LockstepScheduler,
    Replica,
    WireRequest,
    agree_over,
    fingerprint,
    share_over,
    state_digest,
    wire,
)
from runtime.distributed.shard import shard_info
from runtime.engine import ModelRunner, RunnerSettings
from runtime.types import Finished, FinishReason

if TYPE_CHECKING:
    from runtime.batch import RequestHandle
    from runtime.load import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0  # a round's bound, and the slack on every step's
STEP_MARGIN = 3.0  # a step may take this many times its expected time
HELLO_WAIT_S = 600.0  # ranks load their shards at once; one may finish this much later


def settings_of(settings: RunnerSettings) -> dict[str, Any]:
    """The runner settings every rank must share (sent in the handshake): a default that
    depends on a host's memory would otherwise differ per rank."""
    return {
        "prefill_chunk": settings.prefill_chunk,
        "prefix_cache_bytes": settings.prefix_cache_bytes,
        "snapshot_interval": settings.snapshot_interval,
        "max_batch": settings.max_batch,
        "cache_memory_bytes": settings.cache_memory_bytes,
        "kv_bits": settings.kv_bits,
    }


class Lockstep(ModelRunner):
    """What rank 0's runner and a follower share (see the module docstring)."""

    prefix_cache_type = LockstepPrefixCache
    scheduler_type = LockstepScheduler

    def __init__(
        self,
        loaded: LoadedModel,
        settings: RunnerSettings,
        channel: Channel,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        # no disk tier: its writer and its files would differ per rank
        super().__init__(loaded, dataclasses.replace(settings, prefix_cache_dir=None))
        self.channel = channel
        self.timeout = timeout
        self.lockstep = cast(LockstepScheduler, self.scheduler)
        self.lockstep.share = share_over(channel.group)  # no reference back to the runner
        self.trie = cast(LockstepPrefixCache[Any], self.prefix)
        info = shard_info(loaded.model)
        if info is not None and info.mode == "pipeline" and info.size > 1:
            # stages hold different layers, whose caches differ in kind: the group agrees
            # on what depends on the kinds (replica.py)
            self.lockstep.agree = self.trie.agree = agree_over(channel.group)
        self.replicas: dict[int, Replica] = {}
        self.digest = self.state_digest()
        self._stream_thread = 0  # the thread whose stream `_stream` is

    @property
    def fingerprint(self) -> int:
        loaded = self.loaded
        return fingerprint(dict(loaded.config), loaded.context_length, loaded.eos_token_ids)

    def state_digest(self) -> int:
        return state_digest(self.lockstep, self.trie)

    def _ended(self, done: list[tuple[RequestHandle, Finished]]) -> list[Replica]:
        """The replicas `done` ends, forgotten here."""
        out = []
        for handle, _ in done:
            assert isinstance(handle, Replica)
            self.replicas.pop(handle.serial, None)
            out.append(handle)
        return out

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Rounds run on the model's stream, after what it queued (the collectives' order
        must be the same on every rank). MLX streams belong to their thread: a round from
        another one (a close at shutdown) runs on that thread's default stream, when the
        worker that queued on the model's is gone."""
        here = threading.get_ident()
        if self._stream is None:
            self._stream, self._stream_thread = mx.new_stream(mx.default_device()), here
        if self._stream_thread != here:
            yield
            return
        with mx.stream(self._stream):
            yield


class LockstepRunner(Lockstep):
    """Rank 0's runner: the engine's BatchRunner, leading the group. `on_lost` (the
    engine's `halt`) hears once when the group is lost, with why."""

    def __init__(
        self,
        loaded: LoadedModel,
        settings: RunnerSettings,
        channel: Channel,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        slow_bound: float = 300.0,
        on_lost: Callable[[str], None] = lambda _: None,
    ) -> None:
        super().__init__(loaded, settings, channel, timeout=timeout)
        self.slow_bound = slow_bound
        self.on_lost = on_lost
        self.lost: str | None = None  # why the group was lost
        self._lost_lock = threading.Lock()
        self._stopped = False
        self._serial = 0
        self._admitted: list[WireRequest] = []
        self._memory = GroupMemory(settings.cache_memory_bytes)
        self._held: tuple[int, ...] = ()  # each rank's cache bytes, at the last round
        self._watchdog = Watchdog(self._expired, name="mlx-lockstep-watchdog")
        self._hello()

    def _hello(self) -> None:
        """The handshake: the settings out, every rank's model fingerprint back."""
        mine = self.fingerprint
        hello = {"settings": settings_of(self.settings), "fingerprint": mine}
        heard = self.channel.send(Round(Command.HELLO, {"hello": hello}), mine)
        other = [r for r, fp in enumerate(heard.digests) if fp != mine]
        if other:
            why = (
                f"rank {other[0]} loaded a different model than rank 0 (config, context or "
                "end-of-sequence ids differ): give every rank the same model and flags"
            )
            self.channel.send(Round(Command.STOP, {"stop": why}), mine)
            raise GroupLost(why)
        # then wait (unbounded: no watchdog yet) until every follower has built its
        # runner, so that no later round's bound covers a follower's setup
        self.channel.send(Round(Command.IDLE), self.digest)

    @property
    def watched_until(self) -> float | None:
        """When (time.monotonic) the watchdog gives up on the round or step in flight,
        if one is; None between them."""
        return self._watchdog.deadline

    def watch(self) -> None:
        """Start the watchdog (the serve command does, with the engine's)."""
        self._watchdog.start()

    # -- the engine's side --

    def admit(self, handle: RequestHandle) -> None:
        if self.lost is not None:
            raise GroupLost(self.lost)
        req = handle.request
        if req.images:
            raise ValueError("a distributed group serves text only: send the prompt without images")
        self._serial += 1
        replica = Replica(self._serial, req, handle)
        super().admit(replica)  # raises when it cannot run: then the followers never hear of it
        self.replicas[replica.serial] = replica
        room = self.loaded.context_length - len(req.prompt_tokens)
        self._admitted.append(wire(replica.serial, req, min(req.max_tokens, room)))

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        with self._on_stream():
            bound = self._step_bound()
            self._round(Command.STEP, bound=bound, what="a step")
        try:
            done = super().step()
        finally:
            self._watchdog.disarm()
        if self.lost is not None:
            raise GroupLost(self.lost)  # the watchdog gave up on this step while it ran
        self.digest = self.state_digest()
        if any(f.reason is FinishReason.ERROR for _, f in done):
            with self._on_stream():
                self._round(Command.IDLE, what="a check after a failed step")
            self._watchdog.disarm()
        return self._to_clients(done)

    def tick(self) -> None:
        """The engine is idle: a heartbeat round (also carries pending evictions)."""
        if self.lost is None and not self._stopped:
            with self._on_stream():
                self._round(Command.IDLE, what="a heartbeat")
            self._watchdog.disarm()

    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]:
        done = self._to_clients(super().abort(reason, error))
        self._admitted.clear()  # the followers never saw these; rank 0 dropped them too
        if self.lost is None and not self._stopped:
            abort = {"reason": reason.value, "error": error}
            with contextlib.suppress(GroupLost), self._on_stream():
                self._round(Command.ABORT, {"abort": abort}, what="an abort")
                self._watchdog.disarm()
        return done

    def close(self) -> None:
        super().close()
        self.replicas.clear()
        self._admitted.clear()
        if self.lost is None and not self._stopped:
            with contextlib.suppress(GroupLost), self._on_stream():
                self._round(Command.CLOSE, what="a close")
                self._watchdog.disarm()

    def _to_clients(
        self, done: list[tuple[RequestHandle, Finished]]
    ) -> list[tuple[RequestHandle, Finished]]:
        """The clients' handles for the replicas that ended."""
        out = []
        for replica, (_, finished) in zip(self._ended(done), done, strict=True):
            assert replica.real is not None
            out.append((replica.real, finished))
        return out

    def shutdown(self, why: str | None = None) -> None:
        """Tell the followers to leave (the server is done; `why` when it failed)."""
        if self.lost is None and not self._stopped:
            with contextlib.suppress(GroupLost), self._on_stream():
                self._round(Command.STOP, {"stop": why} if why else {}, what="the stop")
        self._stopped = True
        self._watchdog.disarm()
        self._watchdog.stop()

    # -- rounds --

    def _step_bound(self) -> float:
        expected = self.lockstep.expected_seconds()
        return self.slow_bound if expected is None else STEP_MARGIN * expected

    def _round(
        self,
        command: Command,
        extra: dict[str, Any] | None = None,
        *,
        bound: float = 0.0,
        what: str,
    ) -> Heard:
        """Send one round (see the module docstring); the watchdog stays armed for
        `timeout + bound`: the caller disarms it once the step after it is done."""
        if self.lost is not None:
            raise GroupLost(self.lost)
        if self._stopped:
            raise GroupLost("the group was stopped")
        payload: dict[str, Any] = dict(extra or {})
        with self.lock:
            if command in (Command.STEP, Command.IDLE):
                payload.update(self._inputs())
            rates = self.lockstep.measured()
            self.lockstep.rates = rates
            if self.lockstep.memory_bytes:  # by what every rank held at the last round
                self.lockstep.memory_bytes = self._memory.update(self._held)
            memory = self.lockstep.memory_bytes
            message = Round(command, payload, rates, self.lockstep.row_bytes, bound, memory)
            held = self.lockstep.held_bytes()
        self._watchdog.arm(self.timeout + bound, what)
        try:
            heard = self.channel.send(message, self.digest, held)
        except Exception as exc:
            self._lose(f"{self._peer} left the group during {what} ({exc})")
            raise GroupLost(self.lost or str(exc)) from exc
        self._check(heard, what)
        self.digest = self.state_digest()  # what the followers report next time
        self._held = heard.held
        return heard

    def _inputs(self) -> dict[str, Any]:
        """Admissions, cancellations and evictions since the last round."""
        out: dict[str, Any] = {}
        if self._admitted:
            out["admit"], self._admitted = self._admitted, []
        cancels = []
        for serial, replica in self.replicas.items():
            if not replica.frozen and replica.real is not None and replica.real.cancelled:
                replica.frozen = True
                cancels.append(serial)
        if cancels:
            out["cancel"] = cancels
        victims = self.trie.decide_evictions()
        if victims:
            out["evict"] = victims
        return out

    def _check(self, heard: Heard, what: str) -> None:
        """Every follower heard every round and holds the state rank 0 does."""
        for rank in range(1, self.channel.size):
            if heard.seen[rank] != heard.number - 1:
                why = f"rank {rank} is out of step ({heard.seen[rank]} rounds, rank 0 sent {heard.number - 1})"
            elif heard.digests[rank] != self.digest:
                why = f"rank {rank}'s state differs from rank 0's after {what} (a bug: please report it)"
            else:
                continue
            self._lose(why)
            with contextlib.suppress(Exception):
                self.channel.send(Round(Command.STOP, {"stop": why}), self.digest)
            raise GroupLost(why)

    def _expired(self, what: str, bound: float) -> None:
        self._lose(
            f"{self._peer} did not answer within {bound:.0f} s ({what}): frozen, "
            "unreachable or gone"
        )

    @property
    def _peer(self) -> str:
        """Who failed, as far as rank 0 can tell: in a group of two, the other rank."""
        return "rank 1" if self.channel.size == 2 else "a rank"

    def _lose(self, why: str) -> None:
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = why
        self._watchdog.disarm()
        log.error("distributed group lost: %s", why)
        self.on_lost(why)
