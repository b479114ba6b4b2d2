"""Rows of recurrent caches in a running batch: conv and recurrent states stacked on the
batch axis.

A recurrent state folds in every token it has seen, so it cannot forget the last few
the way a token cache drops columns. A speculative verify step (runtime/batch/
speculative.py) feeds each row several tokens, some of which are then rejected: before
that forward the batch asks its recurrent layers to keep their states after every
position (`keep_steps`), the layer hands them over on its way (`RecurrentState.keep`,
the capability `RecurrentCache.capture` gives one sequence's prefill), and `rewind`
takes the states after the positions every row accepted. What is kept lives until the
next `rewind` (a verify step always ends with one) or the next forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from runtime.cache.recurrent import RecurrentCache, RecurrentSnapshot


class BatchRecurrentCache:
    """Rows of recurrent caches, stacked (see the module docstring)."""

    def __init__(self) -> None:
        self.conv_state: mx.array | None = None
        self.recurrent_state: mx.array | None = None
        self._pos: list[int] = []
        self._stepping = False  # the next forward keeps its state after each position
        # the states after the last forward's first n tokens, n -> (conv, recurrent),
        # from 0 (the states it started from) to its length, when it kept them
        self._kept: dict[int, tuple[mx.array, mx.array]] = {}
        self._span = 0  # the tokens of the forward that kept them

    @property
    def rows(self) -> int:
        return len(self._pos)

    @property
    def offset(self) -> mx.array:
        return mx.array(self._pos, dtype=mx.int32)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv_state, self.recurrent_state) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state)

    def keep_steps(self) -> None:
        """Keep the states after every position of the next forward (`rewind`)."""
        self._stepping = True

    def cuts(self, length: int) -> tuple[int, ...]:
        """Where inside the next forward of `length` tokens the layer hands its states
        over (`keep`): after each position, when `keep_steps` asked for it."""
        return tuple(range(1, length)) if self._stepping else ()

    def keep(self, at: int, conv_state: mx.array, recurrent_state: mx.array) -> None:
        """The states after the forward's first `at` tokens, every row's."""
        self._kept[at] = (conv_state, recurrent_state)

    def update(self, conv_state: mx.array, recurrent_state: mx.array, length: int) -> None:
        if self._stepping:
            if self.conv_state is not None and self.recurrent_state is not None:
                self._kept[0] = (self.conv_state, self.recurrent_state)
            self._kept[length] = (conv_state, recurrent_state)
            self._span, self._stepping = length, False
        else:
            self._kept = {}
        self.conv_state, self.recurrent_state = conv_state, recurrent_state
        self._pos = [p + length for p in self._pos]

    def can_rewind(self, n: int) -> bool:
        """Whether the last forward kept the states `n` tokens before its end."""
        return n == 0 or (n <= self._span and self._span - n in self._kept)

    def rewind(self, n: int) -> None:
        """Every row forgets its last `n` tokens: the states the last forward kept after
        its first `length - n` (ValueError where it kept none); what it kept goes."""
        if not self.can_rewind(n):
            raise ValueError(f"cannot rewind {n} tokens: no state was kept there")
        kept, self._kept = self._kept, {}
        if n:
            self.conv_state, self.recurrent_state = kept[self._span - n]
            self._pos = [p - n for p in self._pos]

    def add(self, cache: RecurrentCache) -> None:
        if cache.conv_state is None or cache.recurrent_state is None:
            raise ValueError("a recurrent row joins only after its prompt has run")
        self._kept = {}
        if self.conv_state is None or self.recurrent_state is None:
            self.conv_state, self.recurrent_state = cache.conv_state, cache.recurrent_state
        else:
            self.conv_state = mx.concatenate([self.conv_state, cache.conv_state], axis=0)
            self.recurrent_state = mx.concatenate(
                [self.recurrent_state, cache.recurrent_state], axis=0
            )
        self._pos.append(cache.offset)

    def remove(self, rows: Sequence[int]) -> None:
        self._kept = {}
        keep = [i for i in range(self.rows) if i not in set(rows)]
        if not keep:
            self.conv_state = self.recurrent_state = None
            self._pos = []
            return
        assert self.conv_state is not None and self.recurrent_state is not None
        index = mx.array(keep, dtype=mx.int32)
        self.conv_state = mx.take(self.conv_state, index, axis=0)
        self.recurrent_state = mx.take(self.recurrent_state, index, axis=0)
        self._pos = [self._pos[i] for i in keep]

    def row(self, i: int) -> RecurrentCache:
        assert self.conv_state is not None and self.recurrent_state is not None
        out = RecurrentCache()
        snap = RecurrentSnapshot(
            mx.contiguous(self.conv_state[i : i + 1]),
            mx.contiguous(self.recurrent_state[i : i + 1]),
            self._pos[i],
        )
        out.restore(snap, self._pos[i])
        return out
