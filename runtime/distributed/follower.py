"""A follower: every rank but 0 runs this loop instead of a server. It hears rank 0's
rounds (runtime/distributed/channel.py) and takes the same steps on its shard, with the
same scheduler code (runtime/distributed/lockstep.py), until rank 0 says stop.

A follower never decides: no HTTP, no templates or parsers, no sampling of its own. It
exits 0 when rank 0 ends the group cleanly and 1 when the group fails: rank 0 gone
(a collective raised), rank 0 silent past the round's bound (its watchdog), or rank 0
stopping the group over an error. A blocked collective cannot be interrupted, so the
watchdog ends the process itself (`os._exit`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from runtime.batch import SequenceOutput
from runtime.distributed.channel import Channel, Command, Round, Watchdog
from runtime.distributed.lockstep import DEFAULT_TIMEOUT_S, HELLO_WAIT_S, Lockstep
from runtime.distributed.replica import Diverged, Placeholder, Replica, fingerprint, unwire
from runtime.engine import ModelRunner, RunnerSettings
from runtime.types import FinishReason

if TYPE_CHECKING:
    from runtime.load import LoadedModel

log = logging.getLogger(__name__)

IDLE_GAP_S = 1.0  # an idle rank 0 sends a heartbeat this often (the engine's poll)
FAILED = 1


class Follower(Lockstep):
    """A rank other than 0 (see the module docstring)."""

    def __init__(
        self,
        loaded: LoadedModel,
        settings: RunnerSettings,
        channel: Channel,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        first_wait: float = 300.0,
    ) -> None:
        super().__init__(loaded, settings, channel, timeout=timeout)
        self.first_wait = first_wait  # rank 0 builds its server after the handshake
        self._watchdog = Watchdog(_give_up, name="mlx-follower-watchdog")

    def run(self) -> int:
        """Follow until rank 0 says stop; the process's exit status."""
        self._watchdog.start()
        wait = self.first_wait
        while True:
            self._watchdog.arm(wait, "waiting for rank 0's next round")
            try:
                with self._on_stream():
                    heard = self.channel.receive(self.digest, self.lockstep.held_bytes())
            except Exception as exc:
                log.error("lost rank 0: %s", exc)
                return FAILED
            finally:
                self._watchdog.disarm()
            message = heard.round
            if message.command is Command.STOP:
                return self._stopped(message)
            try:
                self._follow(message)
            except Diverged as exc:
                log.error("this rank's state no longer matches rank 0's: %s", exc)
                return FAILED
            except Exception:  # rank 0 sees this rank gone and stops the group
                log.exception("this rank cannot follow rank 0 any more")
                return FAILED
            self.digest = self.state_digest()
            wait = self.timeout + message.bound + IDLE_GAP_S
            if message.command is Command.CLOSE:
                wait = self.first_wait  # rank 0 shuts down (or restarts its worker)

    def _stopped(self, message: Round) -> int:
        why = message.payload.get("stop")
        if why:
            log.error("rank 0 stopped the group: %s", why)
            return FAILED
        log.info("rank 0 ended the group")
        return 0

    def _follow(self, message: Round) -> None:
        payload = message.payload
        command = message.command
        if command in (Command.STEP, Command.IDLE):
            self._take(payload, message)
        if command is Command.STEP:
            self._watchdog.arm(self.timeout + message.bound, "a step")
            try:
                self._ended(ModelRunner.step(self))
            finally:
                self._watchdog.disarm()
        elif command is Command.ABORT:
            abort = payload.get("abort") or {}
            reason = FinishReason(abort.get("reason", FinishReason.CANCELLED.value))
            self._ended(ModelRunner.abort(self, reason, abort.get("error")))
        elif command is Command.CLOSE:
            ModelRunner.close(self)
            self.replicas.clear()

    def _take(self, payload: dict[str, Any], message: Round) -> None:
        """Rank 0's inputs for the coming step: admissions, cancellations, evictions, its
        timings and the batch's bytes per token."""
        for item in payload.get("admit", ()):
            self._admit(item)
        for serial in payload.get("cancel", ()):
            replica = self.replicas.get(int(serial))
            if replica is not None:
                replica.frozen = True
        with self.lock:
            self.trie.replay_evictions(payload.get("evict", ()))
        self.lockstep.rates = message.rates
        self.lockstep.row_bytes = message.row_bytes
        if message.memory:
            self.lockstep.memory_bytes = message.memory

    def _admit(self, item: dict[str, Any]) -> None:
        serial, request, max_tokens = unwire(item)
        replica = Replica(serial, request, None)
        eos = self.loaded.eos_token_ids
        out = SequenceOutput(replica, self._detok_table, eos, max_tokens)
        sampler = Placeholder(self.loaded.model.args.vocab_size)
        self.scheduler.admit(replica, out, sampler, None)
        self.replicas[serial] = replica


def follow(
    loaded: LoadedModel, channel: Channel, *, timeout: float = DEFAULT_TIMEOUT_S,
    slow_bound: float = 300.0,
) -> int:  # fmt: skip
    """Join rank 0's handshake, then follow; the process's exit status."""
    mine = fingerprint(dict(loaded.config), loaded.context_length, loaded.eos_token_ids)
    watchdog = Watchdog(_give_up, name="mlx-follower-watchdog")
    watchdog.start()
    watchdog.arm(HELLO_WAIT_S, "waiting for rank 0's handshake")
    try:
        heard = channel.receive(mine)
    except Exception as exc:
        log.error("lost rank 0 before the handshake: %s", exc)
        return FAILED
    finally:
        watchdog.disarm()
        watchdog.stop()
    if heard.round.command is not Command.HELLO:
        log.error("rank 0 sent %s before the handshake", heard.round.command.name)
        return FAILED
    hello = heard.round.payload["hello"]
    if int(hello["fingerprint"]) != mine:
        # rank 0 saw it too and sends a stop next: hear it, so the group ends in order
        log.error("this rank loaded a different model than rank 0")
        try:
            channel.receive(mine)
        except Exception as exc:
            log.debug("rank 0's stop did not arrive: %s", exc)
        return FAILED
    settings = RunnerSettings(**hello["settings"])
    follower = Follower(loaded, settings, channel, timeout=timeout, first_wait=slow_bound + timeout)
    return follower.run()


def _give_up(what: str, bound: float) -> None:
    """A follower's watchdog ran out: rank 0 is frozen or gone, and this rank is stuck in
    a collective nothing can interrupt."""
    log.critical("rank 0 did not answer within %.0f s (%s): leaving the group", bound, what)
    logging.shutdown()  # flush the line: os._exit skips it
    sys.stderr.flush()
    os._exit(FAILED)
