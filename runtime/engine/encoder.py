"""The encoder runner: an encoder model's side of the engine (a BatchRunner, so the
engine's queue, worker, watchdog and handles serve it as they serve a chat model).

Inputs of every admitted request wait in one queue, each request's longest first; a
piece of them is as many as fit `piece_tokens` padded tokens, left-padded into one batch,
run through the model a layer at a time, pooled (or scored) and copied out. A request of
1,000 inputs is so many short steps, not one long forward: the worker beats its
heartbeat and takes new requests between them.

The server's chat models come first (runtime/engine/turns.py): while one has work, each
layer of a piece waits for a turn between its steps, one layer a worker step, and a
piece holds as many tokens as a layer can compute in the time a turn allows; while
none has, a step runs a whole piece of `piece_tokens`.

An input identical to one computed recently is served from a small LRU of rows; one
identical to an input still waiting joins it, so it is computed once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from runtime.engine.turns import Turn, Turns
from runtime.load import EncoderTask, LoadedEncoder, ScoreActivation
from runtime.models import pool
from runtime.types import (
    Encoded,
    EncodeInput,
    EncodeRequest,
    Finished,
    FinishReason,
    GenerationStats,
)

if TYPE_CHECKING:
    from runtime.batch import RequestHandle

log = logging.getLogger(__name__)

# waiting inputs a piece is chosen from (the oldest, and the best fits among the next)
WINDOW = 4096
# an input: its tokens, and where a pair's second text begins
_Key = tuple[tuple[int, ...], int | None]


@dataclass(frozen=True)
class EncoderSettings:
    # padded tokens one forward takes at most (one input always fits): the size of the
    # pieces a long request is cut into. Small enough that a piece's activations stay in
    # cache (MiniLM on 2 CPU cores: 512 gave 1.3x the embeddings/s of 2,048), and a chat
    # model's engine thread waits at most one short forward for the cores
    piece_tokens: int = 512
    # requests encoding at once (more wait in the engine's queue): many, so that
    # single-input requests sent together share pieces
    max_jobs: int = 1024
    cache_entries: int = 4096  # recent inputs' rows kept; 0 = none


@dataclass
class _Job:
    handle: RequestHandle
    inputs: tuple[EncodeInput, ...]
    values: npt.NDArray[np.float32]
    left: int  # inputs not yet computed
    tokens: int
    cached_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    def finished(self) -> Encoded:
        seconds = time.perf_counter() - self.started
        stats = GenerationStats(
            prompt_tokens=self.tokens,
            completion_tokens=0,
            cached_tokens=self.cached_tokens,
            prefill_seconds=seconds,
        )
        log.debug(
            "encode request: inputs=%d tokens=%d cached=%d seconds=%.3f (%.1f inputs/s, "
            "%.0f tokens/s)", len(self.inputs), self.tokens, self.cached_tokens, seconds,
            len(self.inputs) / max(seconds, 1e-9), self.tokens / max(seconds, 1e-9),
        )  # fmt: skip
        return Encoded(FinishReason.STOP, stats, values=self.values)


@dataclass
class _Piece:
    """A piece being computed: its inputs and the model's layers still to run."""

    keys: list[_Key]
    padding: list[int]
    tokens: int  # padded: rows x width
    layers: Iterator[mx.array]  # each layer's output, built when asked for
    left: int  # layers not yet run
    seconds: float = 0.0


class EncoderRunner:
    """See the module docstring. `admit`, `step`, `abort` and `close` run on the engine's
    worker thread only."""

    def __init__(self, loaded: LoadedEncoder, settings: EncoderSettings | None = None) -> None:
        self.loaded = loaded
        self.settings = settings or EncoderSettings()
        self._jobs: list[_Job] = []
        self._pending: deque[_Key] = deque()  # inputs to compute, in piece order
        self._waiting: dict[_Key, list[tuple[_Job, int]]] = {}  # input -> rows it fills
        self._recent: OrderedDict[_Key, npt.NDArray[np.float32]] = OrderedDict()
        self._stream: Any = None
        self._piece: _Piece | None = None
        self.turns: Turns | None = None  # the server's (take_turns); None: never waits
        self.pieces = 0  # forwards run
        self.rows_computed = 0
        self.rows_reused = 0  # from the LRU or an identical waiting input
        self._piece_seconds = 0.0
        self._token_seconds = 0.0  # one padded token through one layer, measured

    # -- the engine's side (runtime/engine/types.py's BatchRunner) --

    @property
    def idle(self) -> bool:
        return not self._jobs

    def has_room(self) -> bool:
        return len(self._jobs) < self.settings.max_jobs

    def admit(self, handle: RequestHandle) -> None:
        """Take a request in; raises (the request fails) when it is not one for an
        encoder, or an input cannot be encoded."""
        request = handle.request
        if not isinstance(request, EncodeRequest):
            raise ValueError(f"{self.loaded.name} is an encoder model: it generates no text")
        inputs = request.inputs
        for i, item in enumerate(inputs):
            self._check(i, item)
        values = np.zeros((len(inputs), max(1, self.loaded.width)), dtype=np.float32)
        job = _Job(handle, inputs, values, len(inputs), sum(len(x.tokens) for x in inputs))
        fresh: list[_Key] = []
        for i, item in enumerate(inputs):
            key = (item.tokens, item.second_at)
            row = self._recent.get(key)
            if row is not None:
                self._recent.move_to_end(key)
                self._fill(job, i, row, reused=True)
                continue
            waiters = self._waiting.setdefault(key, [])
            if not waiters:
                fresh.append(key)
            else:
                self.rows_reused += 1
            waiters.append((job, i))
        # longest first: a piece's inputs are of similar length, so little is padding
        self._pending.extend(sorted(fresh, key=lambda k: len(k[0]), reverse=True))
        self._jobs.append(job)

    def take_turns(self, turns: Turns) -> None:
        """Compute in the time the server's chat models leave (runtime/engine/turns.py)."""
        self.turns = turns

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        """A piece, or one layer of it while a chat model has work (see the module
        docstring); the requests that ended."""
        done = self._drop_cancelled()
        if self._stream is None:
            self._stream = mx.new_stream(mx.default_device())
        with mx.stream(self._stream):
            if self._piece is None:
                keys = self._take_piece(self._piece_tokens())
                if keys:
                    self._piece = self._start(keys)
            if self._piece is not None:
                self._advance(self._piece)
        for job in [j for j in self._jobs if j.left == 0]:
            self._jobs.remove(job)
            done.append((job.handle, job.finished()))
        return done

    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]:
        ended = [(job.handle, self._ending(job, reason, error)) for job in self._jobs]
        self._jobs.clear()
        self._pending.clear()
        self._waiting.clear()
        self._piece = None
        return ended

    def close(self) -> None:
        """Release every array and row held (the engine has stopped)."""
        self.abort(FinishReason.CANCELLED, "server shutting down")
        self._recent.clear()
        self.turns = None
        self._stream = None

    def load(self) -> tuple[int, int, int, float]:
        return len(self._jobs), 0, self.pieces, self._piece_seconds

    # -- the work --

    def _check(self, index: int, item: EncodeInput) -> None:
        args = self.loaded.model.args
        where = f"input {index}"
        if not item.tokens:
            raise ValueError(f"{where} has no tokens")
        if len(item.tokens) > self.loaded.max_length:
            raise ValueError(
                f"{where} is {len(item.tokens)} tokens; the model takes {self.loaded.max_length}"
            )
        if min(item.tokens) < 0 or max(item.tokens) >= args.vocab_size:
            raise ValueError(f"{where} holds a token id outside [0, {args.vocab_size})")
        if item.second_at is not None and (
            self.loaded.task is EncoderTask.EMBED or args.type_vocab_size < 2
        ):
            raise ValueError(f"{where}: this model takes no second token type")

    def _piece_tokens(self) -> int:
        """`piece_tokens`; while a chat model has work, what one layer computes in a
        turn's time (one input at least)."""
        limit = self.settings.piece_tokens
        seconds = None if self.turns is None else self.turns.slice_seconds()
        if seconds is None or self._token_seconds <= 0.0:
            return limit
        return max(1, min(limit, int(seconds / self._token_seconds)))

    def _take_piece(self, limit: int) -> list[_Key]:
        """The oldest waiting input, and with it the longest others no longer than it
        (among the next WINDOW waiting) that fit piece_tokens at its width: the oldest
        is served first, and a piece holds little padding however requests interleave
        (one request's inputs are queued longest first already)."""
        while self._pending and not self._waiting.get(self._pending[0]):
            self._waiting.pop(self._pending.popleft(), None)  # every asker was cancelled
        if not self._pending:
            return []
        first = self._pending.popleft()
        width = len(first[0])
        room = limit // width - 1
        if room <= 0:
            return [first]
        fits = [
            key
            for key in itertools.islice(self._pending, WINDOW)
            if len(key[0]) <= width and self._waiting.get(key)
        ]
        fits.sort(key=lambda key: len(key[0]), reverse=True)  # stable: older first on ties
        chosen = fits[:room]
        if chosen:
            taken = set(chosen)
            self._pending = deque(key for key in self._pending if key not in taken)
        return [first, *chosen]

    def _start(self, piece: list[_Key]) -> _Piece:
        """The piece left-padded into one batch, its first layer queued."""
        loaded = self.loaded
        length = max(len(tokens) for tokens, _ in piece)
        ids = np.full((len(piece), length), loaded.model.args.pad_token_id, dtype=np.int32)
        types = np.zeros((len(piece), length), dtype=np.int32)
        padding = []
        for row, (tokens, second) in enumerate(piece):
            pad = length - len(tokens)
            ids[row, pad:] = tokens
            if second is not None:
                types[row, pad + second :] = 1
            padding.append(pad)
        paired = any(second is not None for _, second in piece)
        types_in = mx.array(types) if paired else None
        layers = loaded.model.layers(mx.array(ids), padding, types_in)
        return _Piece(piece, padding, ids.size, layers, loaded.model.args.num_layers)

    def _advance(self, piece: _Piece) -> None:
        """Run the piece's layers: all of them while no chat model has work; one in a
        turn while one has (the worker goes round between turns). A layer is built in
        its turn: building may compute (a CPU kernel evaluates its input)."""
        while piece.left:
            with self._turn() as turn:
                started = time.perf_counter()
                hidden = next(piece.layers)
                mx.eval(hidden)
                piece.left -= 1
                if not piece.left:
                    self._finish(piece, hidden)
                took = time.perf_counter() - started
            piece.seconds += took
            if not piece.left:
                self._piece_seconds += (piece.seconds - self._piece_seconds) / min(self.pieces, 20)
            self._token_seconds += (took / piece.tokens - self._token_seconds) * (
                1.0 if self._token_seconds == 0.0 else 0.1
            )
            if turn.contended:
                return

    def _turn(self) -> contextlib.AbstractContextManager[Turn]:
        if self.turns is None:
            return contextlib.nullcontext(Turn(contended=False))
        return self.turns.background()

    def _finish(self, done: _Piece, hidden: mx.array) -> None:
        loaded = self.loaded
        piece, padding = done.keys, done.padding
        if loaded.pooling is not None:
            out = pool(hidden, padding, loaded.pooling)
        else:
            out = loaded.model.classify(hidden, padding).astype(mx.float32)
            if loaded.activation is ScoreActivation.SIGMOID:
                out = mx.sigmoid(out)
        rows = np.array(out, dtype=np.float32)
        for key, row in zip(piece, rows, strict=True):
            self._remember(key, row.copy())  # a view would keep the whole piece
            for job, index in self._waiting.pop(key, []):
                self._fill(job, index, row)
        self.rows_computed += len(piece)
        self.pieces += 1
        self._piece = None

    def _fill(
        self, job: _Job, index: int, row: npt.NDArray[np.float32], *, reused: bool = False
    ) -> None:
        job.values[index] = row
        job.left -= 1
        if reused:
            self.rows_reused += 1
            job.cached_tokens += len(job.inputs[index].tokens)

    def _remember(self, key: _Key, row: npt.NDArray[np.float32]) -> None:
        limit = self.settings.cache_entries
        if limit <= 0:
            return
        self._recent[key] = row
        self._recent.move_to_end(key)
        while len(self._recent) > limit:
            self._recent.popitem(last=False)

    def _drop_cancelled(self) -> list[tuple[RequestHandle, Finished]]:
        gone = [job for job in self._jobs if job.handle.cancelled]
        for job in gone:
            self._jobs.remove(job)
            for key, waiters in list(self._waiting.items()):
                kept = [w for w in waiters if w[0] is not job]
                if len(kept) != len(waiters):
                    self._waiting[key] = kept
        return [(job.handle, self._ending(job, FinishReason.CANCELLED, None)) for job in gone]

    @staticmethod
    def _ending(job: _Job, reason: FinishReason, error: str | None) -> Finished:
        stats = GenerationStats(prompt_tokens=job.tokens, completion_tokens=0)
        return Finished(reason, stats, error)
