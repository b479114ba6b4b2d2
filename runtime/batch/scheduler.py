"""Continuous batching: the running batch, admission, and prefill interleaved with decode.

Every `step()` does two things on the engine thread:

1. One decode step for the whole running batch: a single forward over every sequence's
   last token (the layers' caches joined by runtime/cache/batch.py), then each sequence
   samples its own next token under its own sampler and grammar. Step N+1's forward is
   queued on the device before step N's tokens are read back, so detokenizing, stop
   strings and grammar masks run on the host while the device computes.
2. Prefill work for the sequence at the head of the prefill queue. With nothing
   decoding, a whole `prefill_chunk`. Otherwise, on a CPU where the model is a plain
   stack over KV caches, a few layers of a chunk of a few hundred tokens
   (runtime/batch/layered_prefill.py: there a small chunk's tokens cost more than a long
   one's). Elsewhere, a chunk sized so that the step takes about `PREFILL_SHARE`
   decode steps; where every layer attends over a token cache, it rides in the decode
   step's forward (runtime/cache/ragged.py): the step then takes about `FUSED_SHARE`
   decode steps, at least `MIN_FUSED_CHUNK` tokens. A chunk run apart pays a weight
   read of its own, so it takes at least `MIN_PREFILL_CHUNK` tokens. When its prompt
   is in, the sequence joins the batch.

   The sizes come from two running measurements: a plain decode step's time (the
   median of the last few, taken only from steps that followed a plain step: one
   right after prefill work also waits for that work's tail), and the prompt tokens'
   own rate (each chunk's time less one decode step's: the fixed cost of a forward,
   mostly reading the weights, which a step pays whatever its chunk). Steps of s
   decode steps give the streams s times their gaps and the prompt at best s / (s - 1)
   times its time alone (more where its tokens cost more in smaller chunks).

The prefix trie (runtime/prefix/cache.py) has one live path, lent to one prefill at a
time: a new sequence restores its longest cached prefix there, its prompt is recorded
when it joins the batch (so a sequence arriving next reuses it: two sequences sharing a
prefix never compute it twice), and a finished sequence's state (prompt and output) is
copied back into the trie between prefills. Sequences join and leave between steps.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from runtime.backend import on_cpu
from runtime.batch.generate import CausalLM, _read, _sample_arrays
from runtime.batch.layered_prefill import LayeredChunk, LayerPace, layer_stack, running_average
from runtime.batch.prompt_prefill import PromptPrefill
from runtime.batch.sequence import SequenceOutput
from runtime.cache.batch import BatchCaches, batchable
from runtime.cache.kv import KVCache
from runtime.cache.ragged import RaggedCache
from runtime.models.base import fusable
from runtime.prefix.cache import Key, Lease, PrefixCache
from runtime.prefix.loan import RowState
from runtime.text.sampling import Sampler, SampleResult
from runtime.types import Finished, FinishReason, GenerationStats
from runtime.vision.spans import PromptImages, decode_forward

if TYPE_CHECKING:
    from runtime.engine.engine import RequestHandle
    from runtime.text.constraints import TokenMatcher

log = logging.getLogger(__name__)

PREFILL_SHARE = 2.0  # a prefill chunk takes about this many decode steps' time...
# ...but no fewer tokens than this: every forward pays a fixed cost (reading the weights,
# on a CPU about one decode step), so tiny chunks would stretch a long prompt's TTFT
# several times over for little gain in the streams' inter-token latency
MIN_PREFILL_CHUNK = 64
# A chunk riding on a decode step shares its weight read, so the streams wait for the
# chunk's compute only: the step may take FUSED_SHARE decode steps. Smaller chunks would
# buy the streams little and stretch the prompt's time to first token.
FUSED_SHARE = 3.0
MIN_FUSED_CHUNK = 32
# a chunk's time less one decode step is its tokens' own time, but no less than this
# share of it (a first step measured long, or a step estimate that outweighs the chunk)
_MIN_OWN_SHARE = 0.25
_PLAIN_STEPS = 9  # plain decode steps the decode step's time is the median of


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


@dataclass(eq=False)
class _Seq:
    handle: RequestHandle
    out: SequenceOutput
    sampler: Sampler
    matcher: TokenMatcher | None
    start: float
    prefill: PromptPrefill | None = None
    caches: list[Any] | None = None  # its own caches, when the model's cannot batch
    input: mx.array | None = None  # (1,) the token the next step feeds
    unread: SampleResult | None = None  # sampled on the device, not yet read
    images: PromptImages | None = None  # its prompt's images (prefix-cache keys)
    layered: LayeredChunk | None = None  # its prompt's chunk on its way through the layers

    @property
    def request(self) -> Any:
        return self.handle.request


class Scheduler:
    """The running batch of one model (see the module docstring)."""

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
    ) -> None:
        self.model = model
        self.prefix = prefix
        self.max_batch = max(1, max_batch)
        self.prefill_chunk = max(1, prefill_chunk)
        self._make = make_caches
        # the batch's caches and the prefix trie's snapshots in memory share this (0: no
        # bound); the batch comes first, the trie gives way (to its disk tier, if any)
        self.memory_bytes = memory_bytes
        self._row_bytes = (0, 0)  # (per token, per row) as measured on the batch
        self._on_begin = on_begin  # the runner logs the lease's cache report
        self._batched = batchable(make_caches())
        self._fuse = self._batched and fusable(model)
        self._stack = layer_stack(model) if self._batched and on_cpu() else None
        self.layered = self._stack is not None  # prompts go a few layers a step (docstring)
        self._layer_pace = LayerPace()
        # whether prefill chunks go past snapshot points (prompt_prefill.keeps_on_the_way);
        # None: each prompt decides from its caches (a distributed group agrees instead)
        self.keeps_inside: bool | None = None
        self._batch: BatchCaches | None = None
        self._rows: list[_Seq] = []
        self._queue: deque[_Seq] = deque()  # admitted, prompt not yet in
        # finished rows' caches and tokens, for the trie (the row: a loan's source)
        self._writebacks: deque[tuple[list[Any], tuple[Key, ...], _Seq]] = deque()
        self._prefill_rate = 0.0  # prompt tokens/s of recent chunks, fixed cost aside
        self._settled = False  # the last step was a plain decode step, nothing else
        # the last plain decode steps' times: their median is the decode step's (one slow
        # step, the engine thread busy elsewhere, must not size every chunk after it)
        self._plain_steps: deque[float] = deque(maxlen=_PLAIN_STEPS)
        self.clock: Callable[[], float] = time.perf_counter  # times the steps and chunks
        self.trie_changed = False
        self.stats = SchedulerStats()

    # -- admission --

    @property
    def idle(self) -> bool:
        return not (self._rows or self._queue or self._writebacks)

    def has_room(self) -> bool:
        """One prefill at a time; the batch bounded by max_batch."""
        return not self._queue and len(self._rows) < self.max_batch

    def admit(
        self, handle: RequestHandle, out: SequenceOutput, sampler: Sampler,
        matcher: TokenMatcher | None,
    ) -> None:  # fmt: skip
        if self.idle:
            mx.reset_peak_memory()
        self._queue.append(_Seq(handle, out, sampler, matcher, time.perf_counter()))
        self._count()

    # -- the step --

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        """One decode step for the batch and one prefill chunk; the sequences that ended."""
        self.trie_changed = False
        done: list[tuple[RequestHandle, Finished]] = []
        rider = self._rider()
        rows = len(self._rows)
        start = self.clock() if self.layered and rows and self._queue else 0.0  # layered
        if self._rows:
            done += self._decode_step(rider)
        prefilled = bool(self._queue) and rider is None
        if prefilled:
            done += self._prefill_step(start)
        if not self._queue or self._queue[0].prefill is None:
            self._write_back()
        self._settled = bool(rows) and rider is None and not prefilled  # a plain step
        self._count()
        self._share_memory()
        return done

    def _share_memory(self) -> None:
        """Leave the trie what the running batch, at its longest, does not need."""
        if self.memory_bytes:
            self.prefix.set_limit(self.memory_bytes - self._projected(self._rows))

    def _projected(self, rows: list[_Seq]) -> int:
        """The batch caches' bytes, every row at its longest (prompt + max_tokens, padded)."""
        per_token, per_row = self._row_bytes
        if not rows:
            return 0
        longest = max(len(r.out.progress.prompt) + r.out.max_tokens for r in rows)
        return len(rows) * (longest * per_token + per_row)

    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]:
        """End every sequence (shutdown, or a failed batched step): nothing goes back to
        the trie except what it already holds."""
        self.prefix.reclaim()  # the live path, if lent to a row, before the rows go
        out = []
        for seq in [*self._rows, *self._queue]:
            if seq.prefill is not None:
                self.prefix.discard(seq.prefill.lease)
            seq.out.progress.reason = reason
            out.append((seq.handle, self._finished(seq, error)))
        self._rows, self._batch = [], None
        self._queue.clear()
        self._writebacks.clear()  # their arrays may belong to a worker that is gone
        self._count()
        return out

    def _count(self) -> None:
        s = self.stats
        s.running, s.prefilling = len(self._rows), len(self._queue)
        s.max_batch_seen = max(s.max_batch_seen, s.running)

    # -- decode --

    def _rider(self) -> _Seq | None:
        """The sequence being prefilled when its next chunk rides on this decode step (one
        forward, runtime/cache/ragged.py): text, a measured decode step, not layered."""
        if not (self._fuse and self._rows and self._queue and self._batch):
            return None
        seq = self._queue[0]
        if seq.prefill is None or seq.prefill.images is not None or seq.handle.cancelled:
            return None
        if self._rates()[0] <= 0 or any(_shift(r) for r in self._rows) or self._layering(seq):
            return None
        return seq

    # -- hooks for a distributed group's lockstep (runtime/distributed/lockstep.py) --

    def _rates(self) -> tuple[float, float]:
        """(decode step seconds, prefill tokens/s) as measured here: what sizes the
        chunks. Lockstep ranks use rank 0's, so that timing never changes a decision."""
        return self.stats.decode_step_seconds, self._prefill_rate

    def _agree(self, rows: list[_Seq]) -> None:
        """Every row in `rows` sampled its next token (`unread`, not yet read). Lockstep
        ranks replace it with rank 0's; a single process keeps its own."""

    def _forward(self, rider: PromptPrefill | None = None, chunk: int = 0) -> list[mx.array]:
        """Queue one step's logits for every row: one (1, V) array per row; with a
        `rider`, its next `chunk` prompt tokens go through the same forward."""
        inputs = [r.input for r in self._rows]
        assert all(i is not None for i in inputs)
        if rider is not None and chunk and self._batch is not None:
            prompt = mx.array(rider.rest[:chunk], dtype=mx.int32)
            tokens = mx.concatenate([*inputs, prompt]).reshape(1, -1)  # type: ignore[list-item]
            layers = zip(self._batch.layers, rider.caches, strict=True)
            hidden = self.model.forward(tokens, [RaggedCache(b, p) for b, p in layers])
            logits = self.model.logits(hidden[0, : len(self._rows)])
            return [logits[i : i + 1] for i in range(len(self._rows))]
        if self._batch is not None:
            tokens = mx.concatenate(inputs).reshape(-1, 1)  # type: ignore[arg-type]
            shifts = [_shift(r) for r in self._rows]
            hidden = decode_forward(self.model, tokens, self._batch.layers, shifts)
            logits = self.model.logits(hidden[:, -1, :])
            return [logits[i : i + 1] for i in range(len(self._rows))]
        out = []
        for row in self._rows:
            assert row.input is not None and row.caches is not None
            hidden = decode_forward(self.model, row.input.reshape(1, 1), row.caches, [_shift(row)])
            out.append(self.model.logits(hidden[:, -1, :]))
        return out

    def _decode_step(self, rider: _Seq | None = None) -> list[tuple[RequestHandle, Finished]]:
        start = self.clock()
        prefill = None if rider is None else rider.prefill
        chunk = 0
        try:
            if rider is not None and prefill is not None:
                chunk = prefill.plan(self._chunk(rider), lambda at: self._pause(rider, at))
            logits = self._forward(prefill, chunk)
            mx.async_eval(logits)
            ended = [i for i, row in enumerate(self._rows) if self._read(row)]
            arrays: list[mx.array] = []
            kept = [row for i, row in enumerate(self._rows) if i not in ended]
            for i, row in enumerate(self._rows):
                if i in ended:
                    continue
                mask = row.matcher.mask() if row.matcher is not None else None
                row.unread = row.sampler.sample(logits[i], mask)
            self._agree(kept)
            for row in kept:
                assert row.unread is not None
                row.input = row.unread.token
                arrays += _sample_arrays(row.unread)
            if chunk and prefill is not None:
                arrays += [a for c in prefill.caches for a in c.state]
            mx.async_eval(arrays)
        except Exception as exc:
            log.exception("batched decode step failed")
            return self.abort(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        done = self._leave(ended)
        s = self.stats
        s.steps += 1
        took = self.clock() - start
        if chunk and rider is not None and prefill is not None:
            s.fused_steps += 1
            self._measured_chunk(chunk, took)
            prefill.advance(chunk, lambda at: self._pause(rider, at))
            if prefill.done:
                try:
                    done += self._join(rider)
                except Exception as exc:
                    log.exception("joining the batch failed")
                    return done + self.abort(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        elif self._settled or s.decode_step_seconds <= 0:
            self._plain_steps.append(took)
            s.decode_step_seconds = statistics.median(self._plain_steps)
        return done

    def _read(self, row: _Seq) -> bool:
        """Read the row's last sampled token back and stream it; True when it ended."""
        if row.unread is not None:
            sampled = _read(row.unread)
            row.unread = None
            if row.matcher is not None:
                row.matcher.advance(sampled.token_id)
            if row.out.accept(sampled):
                return True
        if row.handle.cancelled:
            row.out.progress.reason = FinishReason.CANCELLED
            return True
        return False

    def _leave(self, ended: list[int]) -> list[tuple[RequestHandle, Finished]]:
        if not ended:
            return []
        done = []
        for i in ended:
            row = self._rows[i]
            caches = self._batch.row(i) if self._batch is not None else row.caches
            assert caches is not None
            held = caches[0].offset
            tokens = (row.out.progress.prompt + tuple(row.out.progress.generated))[:held]
            keys = tokens if row.images is None else row.images.keys(tokens)
            self._writebacks.append((caches, keys, row))
            done.append((row.handle, self._finished(row)))
        if self._batch is not None:
            self._batch.remove(ended)
        self._rows = [r for i, r in enumerate(self._rows) if i not in set(ended)]
        if not self._rows:
            self._batch = None
        return done

    # -- prefill --

    def _chunk(self, seq: _Seq) -> int:
        cap = seq.request.prefill_chunk or self.prefill_chunk
        if not self._rows:
            return cap
        step_seconds, prefill_rate = self._rates()
        if prefill_rate <= 0:
            return min(cap, 2 * MIN_PREFILL_CHUNK)
        fused = self._rider() is seq
        share = FUSED_SHARE if fused else PREFILL_SHARE
        budget = (share - 1) * step_seconds  # the step's fixed cost is one decode step
        floor = MIN_FUSED_CHUNK if fused else MIN_PREFILL_CHUNK
        return max(min(cap, floor), min(cap, int(prefill_rate * budget)))

    def _prefill_step(self, start: float = 0.0) -> list[tuple[RequestHandle, Finished]]:
        seq = self._queue[0]
        if seq.prefill is None and not self._fits(seq):
            return []  # waits (first in line) until running sequences free memory
        try:
            if seq.prefill is None:
                self._begin(seq)
            assert seq.prefill is not None
            if seq.handle.cancelled:
                seq.out.progress.reason = FinishReason.CANCELLED
                if seq.layered is not None:
                    seq.layered.undo()
                self._queue.popleft()
                self._end_prefill(seq)
                return [(seq.handle, self._finished(seq))]
            if self._layering(seq):
                return self._layered_step(seq, start)
            n = self._chunk(seq)
            started = self.clock()
            ran = seq.prefill.run(self.model, n, lambda at: self._pause(seq, at))
            self._measured_chunk(ran, self.clock() - started)
            if seq.prefill.done:
                return self._join(seq)
        except Exception as exc:
            log.exception("prefill failed")
            if seq.prefill is not None:
                self.prefix.discard(seq.prefill.lease)
            seq.prefill, seq.layered = None, None
            self._queue.popleft()
            seq.out.progress.reason = FinishReason.ERROR
            self.trie_changed = True
            return [(seq.handle, self._finished(seq, f"{type(exc).__name__}: {exc}"))]
        return []

    def _layering(self, seq: _Seq) -> bool:
        """Whether `seq`'s prompt goes a few layers per step: a chunk of it is on the way,
        or others decode, a decode step was measured (it sizes the steps) and more than
        `LayerPace.min_prompt` tokens are left (a shorter rest rides if it can)."""
        if seq.layered is not None:
            return True
        if not (self.layered and self._rows and seq.prefill and seq.images is None):
            return False
        return self._rates()[0] > 0 and len(seq.prefill.rest) > self._layer_pace.min_prompt

    def _layered_step(self, seq: _Seq, start: float) -> list[tuple[RequestHandle, Finished]]:
        """A few layers of the prompt's chunk (a new one if none is on the way); all it has
        left when nothing decodes any more."""
        assert seq.prefill is not None and self._stack is not None
        pace, step, depth = self._layer_pace, self._rates()[0], len(self._stack.layers)
        pause = functools.partial(self._pause, seq)
        if seq.layered is None:
            cap = seq.request.prefill_chunk or self.prefill_chunk
            tokens = pace.tokens(cap, step, depth)
            seq.layered = LayeredChunk(self._stack, seq.prefill, tokens, pause)
        chunk = seq.layered
        chunk.per_step = chunk.per_step or pace.fit(chunk.tokens, step, depth)
        layers = min(max(1, chunk.per_step), chunk.left) if self._rows else chunk.left
        if layers:
            chunk.run(layers)
            self.stats.layered_steps += 1
            if self._rows and start:
                pace.measured(chunk.tokens * layers, self._own(self.clock() - start))
        self.stats.prefill_chunk_tokens = chunk.tokens
        if not chunk.done:
            return []
        seq.layered = None
        chunk.finish(pause)
        return self._join(seq) if seq.prefill.done else []

    def _measured_chunk(self, tokens: int, took: float) -> None:
        """A chunk of `tokens` took `took` seconds, a forward's fixed cost included."""
        if tokens > 0 and took > 0:
            rate = tokens / self._own(took)
            self._prefill_rate = running_average(self._prefill_rate, rate)
            self.stats.prefill_chunk_tokens = tokens

    def _own(self, took: float) -> float:
        """A step's or chunk's time less one decode step: its prompt tokens' own time."""
        return max(took - self.stats.decode_step_seconds, _MIN_OWN_SHARE * took)

    def _fits(self, seq: _Seq) -> bool:
        """Whether the batch's caches, with `seq` joined and every row at its longest,
        stay within the budget (the trie gives way to them). Alone, a sequence always
        runs: the context length bounds it."""
        if not self._rows or not self.memory_bytes or not self._row_bytes[0]:
            return True
        return self._projected([*self._rows, seq]) <= self.memory_bytes

    def _pause(self, seq: _Seq, at: int) -> None:
        assert seq.prefill is not None
        self.prefix.snapshot_at(seq.prefill.lease, at)

    def _begin(self, seq: _Seq) -> None:
        self._write_back()  # the trie's live caches are free only between prefills
        req = seq.request
        seq.images = PromptImages.of(self.model, req.images, req.prompt_tokens)
        keys = req.prompt_tokens if seq.images is None else seq.images.keys(req.prompt_tokens)
        lease = self.prefix.begin(keys, pin=req.pin, boundaries=req.boundaries)
        self._on_begin(lease)
        seq.out.progress.reused = lease.reused
        seq.prefill = PromptPrefill(lease, req.prompt_tokens, seq.images, self.keeps_inside)
        self.trie_changed = True

    def _end_prefill(self, seq: _Seq) -> None:
        """Record the prompt read so far in the trie and give its live caches back."""
        assert seq.prefill is not None
        held = seq.prefill.offset
        self.prefix.end(seq.prefill.lease, seq.prefill.lease.tokens[:held])
        seq.prefill = None
        self.trie_changed = True

    def _join(self, seq: _Seq) -> list[tuple[RequestHandle, Finished]]:
        """The prompt (all but its last token) is in: copy the caches into the batch.

        The first token is sampled alone first when the sequence has nothing to join
        with yet (a one-token prompt), or when joining would cost more than a forward of
        its own: it may end there (max_tokens 1, or EOS), and a prompt longer than every
        running row would pad them all to its length in the batch's buffers."""
        assert seq.prefill is not None
        caches = seq.prefill.caches
        seq.input = mx.array(seq.request.prompt_tokens[-1:], dtype=mx.int32)
        longest = max((len(r.out.progress.prompt) + len(r.out.progress.generated)
                       for r in self._rows), default=0)  # fmt: skip
        alone = seq.prefill.offset == 0 or seq.out.max_tokens <= 1 or seq.prefill.offset > longest
        if self._batched and alone:
            self._first_alone(seq, caches)
            if self._read(seq):  # it ended at its first token: it never joins
                self._queue.popleft()
                self._end_prefill(seq)
                return [(seq.handle, self._finished(seq))]
        if self._batched:
            if self._batch is None:
                self._batch = BatchCaches(caches)
            self._batch.add(caches)
            self._row_bytes = self._batch.bytes_per_token()
        else:
            seq.caches = _copy(caches, self._make())
        self._queue.popleft()
        self._end_prefill(seq)
        self._rows.append(seq)
        if self._batched:  # the trie's copy of the prompt goes; the row's is the one
            self.prefix.lend(lambda: self._row_state(seq))
        return []

    def _row_state(self, seq: _Seq) -> RowState | None:
        """A sequence's keys and values in every layer, wherever they are now: its
        batch row, or its caches waiting to go back to the trie (None: gone)."""
        i = next((i for i, r in enumerate(self._rows) if r is seq), None)
        if i is not None and self._batch is not None:
            return self._batch.views(i)
        for caches, _, row in self._writebacks:
            if row is seq and all(isinstance(c, KVCache) and c.keys is not None for c in caches):
                return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
        return None

    def _first_alone(self, seq: _Seq, caches: list[Any]) -> None:
        """The sequence's first decode step, in a forward of its own."""
        assert seq.input is not None
        hidden = decode_forward(self.model, seq.input.reshape(1, 1), caches, [_shift(seq)])
        mask = seq.matcher.mask() if seq.matcher is not None else None
        seq.unread = seq.sampler.sample(self.model.logits(hidden[:, -1, :]), mask)
        self._agree([seq])
        seq.input = seq.unread.token
        mx.eval([*_sample_arrays(seq.unread), *[a for c in caches for a in c.state]])
        assert seq.prefill is not None
        seq.prefill.offset += 1

    # -- back to the trie --

    def _write_back(self) -> None:
        while self._writebacks:
            caches, tokens, _ = self._writebacks.popleft()
            if tokens:
                self.prefix.adopt(tokens, caches)
                self.trie_changed = True

    def _finished(self, seq: _Seq, error: str | None = None) -> Finished:
        p = seq.out.progress
        end = time.perf_counter()
        first = p.first_at if p.first_at is not None else end
        stats = GenerationStats(
            prompt_tokens=len(p.prompt),
            completion_tokens=len(p.generated),
            cached_tokens=p.reused,
            prefill_seconds=first - seq.start,
            decode_seconds=end - first,
            peak_memory_bytes=int(mx.get_peak_memory()),
        )
        log.debug(
            "request %s: prompt=%d reused=%d computed=%d completion=%d "
            "prefill=%.1f tok/s decode=%.1f tok/s",
            p.reason.value, stats.prompt_tokens, p.reused, stats.prompt_tokens - p.reused,
            stats.completion_tokens, stats.prefill_tps, stats.decode_tps,
        )  # fmt: skip
        return Finished(p.reason, stats, error, stop_string=p.stop_string)


def _shift(seq: _Seq) -> int:
    """Rotary position minus offset of the sequence's decode steps (multimodal RoPE)."""
    return 0 if seq.images is None else seq.images.shift


def _copy(caches: Sequence[Any], fresh: list[Any]) -> list[Any]:
    """Copies of `caches` (through their own snapshots), for a row that decodes alone."""
    for src, dst in zip(caches, fresh, strict=True):
        if src.offset and not dst.restore(src.snapshot(0), src.offset):
            raise RuntimeError(f"{type(src).__name__} could not be copied")
    return fresh
