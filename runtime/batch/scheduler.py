"""Continuous batching: admission, and prefill interleaved with the running batch's decode.

Every `step()` does two things on the engine thread:

1. One decode step for the whole running batch (runtime/batch/running.py): a single
   forward over every sequence's last token, then each sequence samples its own next
   token under its own sampler and grammar.
2. Prefill work for the sequence at the head of the prefill queue. With nothing
   decoding, a whole `prefill_chunk`. Otherwise, on a CPU where the model is a plain
   stack over KV caches, a few layers of a chunk of a few hundred tokens
   (runtime/batch/layered_prefill.py: there a small chunk's tokens cost more than a long
   one's). Elsewhere, a chunk sized by the measured step times (runtime/batch/pacing.py);
   where every layer attends over a token cache, it rides in the decode step's forward
   (runtime/cache/ragged.py). When its prompt is in, the sequence joins the batch.

The prefix trie (runtime/prefix/cache.py) has one live path, lent to one prefill at a
time: a new sequence restores its longest cached prefix there, its prompt is recorded
when it joins the batch (so a sequence arriving next reuses it: two sequences sharing a
prefix never compute it twice), and a finished sequence's state (prompt and output) is
copied back into the trie between prefills. Sequences join and leave between steps.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from runtime.backend import on_cpu
from runtime.batch.generate import CausalLM
from runtime.batch.layered_prefill import LayeredChunk, LayerPace, layer_stack
from runtime.batch.pacing import ChunkPacing, chunk_size
from runtime.batch.running import RunningBatch
from runtime.batch.sequence import Seq, SequenceOutput
from runtime.batch.speculative import Speculation
from runtime.batch.trie_link import TrieLink
from runtime.cache import batchable
from runtime.models.base import fusable
from runtime.prefix import Lease, PrefixCache, RowState
from runtime.text import Sampler
from runtime.types import Finished, FinishReason

if TYPE_CHECKING:
    from runtime.batch.handle import RequestHandle
    from runtime.text import TokenMatcher

log = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    """What /health and /metrics show of the running batch."""

    running: int = 0  # sequences decoding
    prefilling: int = 0  # sequences admitted whose prompt is still being read
    steps: int = 0  # batched decode steps taken
    decode_step_seconds: float = 0.0  # running average of one decode step
    fused_steps: int = 0  # decode steps that carried a prefill chunk
    layered_steps: int = 0  # steps that took a prompt's chunk through some layers
    prefill_chunk_tokens: int = 0  # the size of the last prefill chunk
    max_batch_seen: int = 0


class Scheduler:
    """The running batch of one model, and the queue of prompts waiting to join it (see
    the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        prefix: PrefixCache[Any],
        *,
        make_caches: Callable[[], list[Any]],
        max_batch: int,
        prefill_chunk: int,
        memory_bytes: int = 0,
        on_begin: Callable[[Lease[Any]], None] = lambda _: None,
        speculative: str = "off",
    ) -> None:
        self.model = model
        self.prefix = prefix
        self.max_batch = max(1, max_batch)
        self.prefill_chunk = max(1, prefill_chunk)
        # the batch's caches and the prefix trie's snapshots in memory share this (0: no
        # bound); the batch comes first, the trie gives way (to its disk tier, if any)
        self.memory_bytes = memory_bytes
        self._trie = TrieLink(prefix, model, on_begin)
        batched = batchable(make_caches())
        self.running = RunningBatch(model, make_caches, batched=batched)
        self._fuse = batched and fusable(model)
        self._stack = layer_stack(model) if batched and on_cpu() else None
        self.layered = self._stack is not None  # prompts go a few layers a step (docstring)
        self._layer_pace = LayerPace()
        self.pacing = ChunkPacing()  # sizes the prefill chunks (runtime/batch/pacing.py)
        # whether prefill chunks go past snapshot points (prompt_prefill.keeps_on_the_way);
        # None: each prompt decides from its caches (a distributed group agrees instead)
        self.keeps_inside: bool | None = None
        self._queue: deque[Seq] = deque()  # admitted, prompt not yet in
        self.clock: Callable[[], float] = time.perf_counter  # times the steps and chunks
        self.stats = SchedulerStats()
        self.speculation = Speculation(speculative)  # runtime/batch/speculative.py

    @property
    def trie_changed(self) -> bool:
        """Whether the last step changed the prefix trie."""
        return self._trie.changed

    # -- admission --

    @property
    def idle(self) -> bool:
        return not (self.running.rows or self._queue or self._trie.writebacks)

    def waiting(self) -> tuple[Seq, ...]:
        """Admitted, prompt not in yet, first in line first (being read: has a prefill)."""
        return tuple(self._queue)

    def has_room(self) -> bool:
        """One prefill at a time; the batch bounded by max_batch."""
        return not self._queue and len(self.running) < self.max_batch

    def admit(
        self, handle: RequestHandle, out: SequenceOutput, sampler: Sampler,
        matcher: TokenMatcher | None,
    ) -> None:  # fmt: skip
        if self.idle:
            mx.reset_peak_memory()
        self._queue.append(Seq(handle, out, sampler, matcher, time.perf_counter()))
        self._count()

    # -- the step --

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        """One decode step for the batch and one prefill chunk; the sequences that ended."""
        self._trie.changed = False
        done: list[tuple[RequestHandle, Finished]] = []
        rider = self._rider()
        rows = len(self.running)
        start = self.clock() if self.layered and rows and self._queue else 0.0  # layered
        if self.running.rows:
            done += self._decode_step(rider)
        prefilled = bool(self._queue) and rider is None
        if prefilled:
            done += self._prefill_step(start)
        if not self._queue or self._queue[0].prefill is None:
            self._trie.write_back()
        self.pacing.settled = bool(rows) and rider is None and not prefilled  # a plain step
        self._count()
        if self.memory_bytes:  # the trie keeps what the batch, at its longest, leaves
            self.prefix.set_limit(_budget(self) - self.running.projected())
        return done

    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]:
        """End every sequence (shutdown, or a failed batched step): nothing goes back to
        the trie except what it already holds."""
        self.prefix.reclaim()  # the live path, if lent to a row, before the rows go
        out = []
        for seq in [*self.running.rows, *self._queue]:
            if seq.prefill is not None:
                self.prefix.discard(seq.prefill.lease)
            seq.out.progress.reason = reason
            out.append((seq.handle, seq.finished(error)))
        self.running.clear()
        self._queue.clear()
        self._trie.writebacks.clear()  # their arrays may belong to a worker that is gone
        self._count()
        return out

    def _count(self) -> None:
        s, pace = self.stats, self.pacing
        s.running, s.prefilling = len(self.running), len(self._queue)
        s.max_batch_seen = max(s.max_batch_seen, s.running)
        s.decode_step_seconds, s.prefill_chunk_tokens = pace.decode_step_seconds, pace.chunk_tokens

    # -- decode --

    def _rider(self) -> Seq | None:
        """The sequence being prefilled when its next chunk rides on this decode step (one
        forward, runtime/cache/ragged.py): text, a measured decode step, not layered."""
        if not (self._fuse and self.running.rows and self._queue and self.running.caches):
            return None
        if self.speculation.verifying:  # a verify step carries no prompt chunk
            return None
        seq = self._queue[0]
        if seq.prefill is None or seq.prefill.images is not None or seq.handle.cancelled:
            return None
        if seq.prefill.hidden_to is not None:  # its chunks' hidden states feed an MTP head
            return None
        if self._rates()[0] <= 0 or any(r.shift for r in self.running.rows):
            return None
        return None if self._layering(seq) else seq

    # -- hooks for a distributed group's lockstep (runtime/distributed/lockstep.py) --

    def _rates(self) -> tuple[float, float]:
        """(decode step seconds, prefill tokens/s) as measured here: what sizes the
        chunks. Lockstep ranks use rank 0's, so that timing never changes a decision."""
        return self.pacing.decode_step_seconds, self.pacing.prefill_rate

    def _agree(self, rows: list[Seq]) -> None:
        """Every row in `rows` sampled its next token (`unread`, not yet read). Lockstep
        ranks replace it with rank 0's; a single process keeps its own."""

    def _decode_step(self, rider: Seq | None = None) -> list[tuple[RequestHandle, Finished]]:
        start = self.clock()
        prefill = None if rider is None else rider.prefill
        chunk = 0
        try:
            if rider is not None and prefill is not None:
                chunk = prefill.plan(self._chunk(rider), lambda at: self._trie.pause(rider, at))
            verifying = self.speculation.verifying
            if verifying:
                ended = self.speculation.step(self.running, self._rates()[0], self._agree)
            else:
                ended = self.running.decode(prefill, chunk, self._agree)
        except Exception as exc:
            log.exception("batched decode step failed")
            return self.abort(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        done = self._leave(ended)
        s = self.stats
        s.steps += 1
        took = self.clock() - start
        if chunk and rider is not None and prefill is not None:
            s.fused_steps += 1
            self.pacing.measured_chunk(chunk, took)
            prefill.advance(chunk, lambda at: self._trie.pause(rider, at))
            if prefill.done:
                try:
                    done += self._join(rider)
                except Exception as exc:
                    log.exception("joining the batch failed")
                    return done + self.abort(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        elif not verifying:  # (a verify step times itself)
            self.pacing.decode_step(took)
        self.speculation.plan(self.running, self._rates()[0])
        return done

    def _leave(self, ended: list[int]) -> list[tuple[RequestHandle, Finished]]:
        if not ended:
            return []
        done = []
        for caches, row in self.running.leave(ended):
            self._trie.keep(caches, row)
            self.speculation.finished(row)
            done.append((row.handle, row.finished()))
        return done

    # -- prefill --

    def _chunk(self, seq: Seq) -> int:
        cap = seq.request.prefill_chunk or self.prefill_chunk
        if not self.running.rows:
            return cap
        step_seconds, prefill_rate = self._rates()
        return chunk_size(cap, step_seconds, prefill_rate, fused=self._rider() is seq)

    def _prefill_step(self, start: float = 0.0) -> list[tuple[RequestHandle, Finished]]:
        seq = self._queue[0]
        if seq.prefill is None and not self.running.fits(seq, _budget(self)):
            return []  # waits (first in line) until running sequences free memory
        try:
            if seq.prefill is None:
                self._trie.begin(seq, self.keeps_inside)
                self.speculation.prefilling(seq, batched=self.running.batched)
            assert seq.prefill is not None
            if seq.handle.cancelled:
                seq.out.progress.reason = FinishReason.CANCELLED
                if seq.layered is not None:
                    seq.layered.undo()
                self._queue.popleft()
                self._trie.end(seq)
                return [(seq.handle, seq.finished())]
            if self._layering(seq):
                return self._layered_step(seq, start)
            n = self._chunk(seq)
            started = self.clock()
            ran = seq.prefill.run(self.model, n, lambda at: self._trie.pause(seq, at))
            self.pacing.measured_chunk(ran, self.clock() - started)
            if seq.prefill.done:
                return self._join(seq)
        except Exception as exc:
            log.exception("prefill failed")
            if seq.prefill is not None:
                self.prefix.discard(seq.prefill.lease)
            seq.prefill, seq.layered = None, None
            self._queue.popleft()
            seq.out.progress.reason = FinishReason.ERROR
            self._trie.changed = True
            return [(seq.handle, seq.finished(f"{type(exc).__name__}: {exc}"))]
        return []

    def _layering(self, seq: Seq) -> bool:
        """Whether `seq`'s prompt goes a few layers per step: a chunk of it is on the way,
        or others decode, a decode step was measured (it sizes the steps) and more than
        `LayerPace.min_prompt` tokens are left (a shorter rest rides if it can)."""
        if seq.layered is not None:
            return True
        if not (self.layered and self.running.rows and seq.prefill and seq.images is None):
            return False
        return self._rates()[0] > 0 and len(seq.prefill.rest) > self._layer_pace.min_prompt

    def _layered_step(self, seq: Seq, start: float) -> list[tuple[RequestHandle, Finished]]:
        """A few layers of the prompt's chunk (a new one if none is on the way); all it has
        left when nothing decodes any more."""
        assert seq.prefill is not None and self._stack is not None
        pace, step, depth = self._layer_pace, self._rates()[0], len(self._stack.layers)
        pause = functools.partial(self._trie.pause, seq)
        if seq.layered is None:
            cap = seq.request.prefill_chunk or self.prefill_chunk
            tokens = pace.tokens(cap, step, depth)
            seq.layered = LayeredChunk(self._stack, seq.prefill, tokens, pause)
        chunk = seq.layered
        chunk.per_step = chunk.per_step or pace.fit(chunk.tokens, step, depth)
        decoding = bool(self.running.rows)
        layers = min(max(1, chunk.per_step), chunk.left) if decoding else chunk.left
        if layers:
            chunk.run(layers)
            self.stats.layered_steps += 1
            if decoding and start:
                pace.measured(chunk.tokens * layers, self.pacing.own(self.clock() - start))
        self.pacing.chunk_tokens = chunk.tokens
        if not chunk.done:
            return []
        seq.layered = None
        chunk.finish(pause)
        return self._join(seq) if seq.prefill.done else []

    def _join(self, seq: Seq) -> list[tuple[RequestHandle, Finished]]:
        """The prompt (all but its last token) is in: copy the caches into the batch.

        The first token is sampled alone first when the sequence has nothing to join
        with yet (a one-token prompt), or when joining would cost more than a forward of
        its own: it may end there (max_tokens 1, or EOS), and a prompt longer than every
        running row would pad them all to its length in the batch's buffers."""
        assert seq.prefill is not None
        caches = seq.prefill.caches
        seq.input = mx.array(seq.request.prompt_tokens[-1:], dtype=mx.int32)
        longest = self.running.longest()
        alone = seq.prefill.offset == 0 or seq.out.max_tokens <= 1 or seq.prefill.offset > longest
        batched = self.running.batched
        if batched and alone:
            self.speculation.first_step(seq, self.running.first_alone(seq, caches, self._agree))
            if seq.read():  # it ended at its first token: it never joins
                self._queue.popleft()
                self._trie.end(seq)
                return [(seq.handle, seq.finished())]
        # the row's buffers are the live caches' where the trie lets go of them, else copies
        self.running.join(seq, caches, own=self.prefix.lets_go())
        if batched and self.speculation.drafts(seq.request):
            self.speculation.start(seq, self.running)
        self._queue.popleft()
        self._trie.end(seq)
        if batched:  # the trie's copy of the prompt goes; the row's is the one
            self.prefix.lend(lambda: self._row_state(seq))
        return []

    def _row_state(self, seq: Seq) -> RowState | None:
        """A sequence's keys and values in every layer, wherever they are now: its
        batch row, or its caches waiting to go back to the trie (None: gone)."""
        state = self.running.views(seq)
        return state if state is not None else self._trie.kept_state(seq)


def _budget(scheduler: Scheduler) -> int:
    """The memory the batch's caches and the trie share: `memory_bytes` less what
    drafting's own caches hold (an MTP head's, projected as the batch's are)."""
    if not scheduler.memory_bytes:
        return 0
    rows = [*scheduler.running.rows, *scheduler.waiting()]
    return max(1, scheduler.memory_bytes - scheduler.speculation.held_bytes(rows))
