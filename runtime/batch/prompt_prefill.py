"""A prompt read into its caches in chunks (the scheduler's prefill of one sequence),
pausing at the prefix trie's snapshot points so that layers which cannot rewind get
restore points there.

A chunk stops at a snapshot point, unless every layer can give its state at the point
after going past it: layers that rewind (KV caches) and recurrent layers asked to keep
their states on the way (`RecurrentCache.capture`). Then the points inside the chunk
cost no forward of their own: a hybrid model's follow-up turn, whose last messages hold
a few snapshot points, reads its new tokens in one forward instead of one per point.

`hidden_to`, when set (a row that drafts with the model's MTP head: runtime/batch/
mtp.py), takes each text chunk's final hidden states and gives back arrays to evaluate
with the chunk; otherwise the hidden states are never kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import mlx.core as mx

from runtime.batch.generate import CausalLM
from runtime.cache import KVCache, QuantizedKVCache, RecurrentCache, reserve_prompt
from runtime.models.base import CausalLM as ModelShell
from runtime.models.decoder import LayerStack
from runtime.prefix import Lease
from runtime.vision.spans import PromptImages

# (the chunk's first prompt position, its hidden states (n, D) after the final norm) ->
# arrays evaluated with the chunk (runtime/batch/mtp.py `MTPLookup.prompt`)
HiddenSink: TypeAlias = Callable[[int, mx.array], list[mx.array]]

# A chunk of at least this many tokens goes through a plain stack's layers a piece at a
# time (`stepwise_forward`); a shorter one's activations are small, and the pieces'
# waits would cost more of its time (at 256 tokens, 49 MB above the caches as one
# graph, 20 MB in pieces, 0.6% slower).
STEPWISE_TOKENS = 256


class PromptPrefill:
    """A prompt read into its caches in chunks, pausing at the trie's snapshot points."""

    def __init__(
        self,
        lease: Lease[Any],
        prompt: Sequence[int],
        images: PromptImages | None = None,
        keeps: bool | None = None,
    ) -> None:
        """`keeps`: whether chunks go past snapshot points (`keeps_on_the_way`); None
        decides from the lease's caches (a distributed group agrees on it instead)."""
        self.lease = lease
        self.caches = lease.caches
        self.keeps = keeps_on_the_way(self.caches) if keeps is None else keeps
        self.rest = list(prompt[lease.reused : -1])  # the last token starts decoding
        self.offset = lease.reused
        self.marks = [p for p in lease.snapshot_points if p > self.offset]
        self.images = images  # a chunk never ends inside an image's span
        if images is not None:
            self.marks = images.marks(self.marks)
        reserve_prompt(self.caches, len(prompt))
        self.hidden_to: HiddenSink | None = None  # (module docstring)

    @property
    def done(self) -> bool:
        return not self.rest

    def plan(self, n: int, on_pause: Callable[[int], None]) -> int:
        """How many of up to `n` tokens the next chunk takes: it stops at a snapshot
        point (pausing first at one it stands on) and never cuts an image's span."""
        if self.marks and self.marks[0] == self.offset:
            on_pause(self.marks.pop(0))
        n = min(n, len(self.rest))
        if self.marks:
            n = min(n, self.marks[0] - self.offset)
        if n > 0 and self.images is not None:
            n = self.images.chunk(self.offset, n)
        return max(n, 0)

    def advance(self, n: int, on_pause: Callable[[int], None]) -> None:
        """`n` planned tokens went through the model."""
        self.rest = self.rest[n:]
        self.offset += n
        if self.done and self.marks and self.marks[0] == self.offset:
            on_pause(self.marks.pop(0))

    def run(self, model: CausalLM, n: int, on_pause: Callable[[int], None]) -> int:
        """Feed up to `n` tokens in a forward of their own; return how many ran. Where
        every layer can give its state at a point it went past (`keeps`), the snapshot
        points inside the chunk do not cut it: the layers keep their states there."""
        inside = self.take_inside(n)
        n = self.plan(n, on_pause)
        if n <= 0:
            return 0
        for c in self.caches:
            if isinstance(c, RecurrentCache):
                c.capture(tuple(inside))
        handed: list[mx.array] = []
        if self.images is None:
            tokens = mx.array(self.rest[:n], dtype=mx.int32)[None]
            hidden = stepwise_forward(model, tokens, self.caches)
            if self.hidden_to is not None:
                handed = self.hidden_to(self.offset, hidden[0])
        else:
            self.images.forward(self.rest[:n], self.caches, self.offset)
        kept = [
            a
            for c in self.caches
            if isinstance(c, RecurrentCache)
            for s in c.captured.values()
            for a in s
        ]
        mx.eval([a for c in self.caches for a in c.state], kept, handed)
        for at in inside:
            on_pause(at)
        for c in self.caches:
            if isinstance(c, RecurrentCache):
                c.capture(())
        mx.clear_cache()
        self.advance(n, on_pause)
        return n

    def take_inside(self, n: int) -> list[int]:
        """The snapshot points inside the next chunk of up to `n` tokens that it goes
        past (`_inside`), taken off the points the chunk stops at: the caller records
        them once the chunk is in."""
        # a chunk of a prompt with images may end short of `n` (`PromptImages.chunk`),
        # unless they are causal: then the points it goes past are known here
        causal = self.images is None or self.images.causal
        inside = self._inside(n) if causal else []
        self.marks = [m for m in self.marks if m not in inside]
        return inside

    def _inside(self, n: int) -> list[int]:
        """The snapshot points strictly inside the next chunk of up to `n` tokens, if it
        `keeps`; otherwise none, and the chunk stops at the first point."""
        if not self.keeps:
            return []
        end = self.offset + min(n, len(self.rest))
        return [m for m in self.marks if self.offset < m < end]


def stepwise_forward(model: CausalLM, tokens: mx.array, caches: list[Any]) -> mx.array:
    """`model.forward(tokens, caches)` for a prompt chunk: a piece at a time
    (`LayerStack.stepwise`, which bounds the activations held at once) where the model is
    a plain stack and the chunk has `STEPWISE_TOKENS` or more; as one graph otherwise."""
    body = getattr(model, "model", None)
    if (
        tokens.shape[-1] >= STEPWISE_TOKENS
        and type(model).forward is ModelShell.forward
        and isinstance(body, LayerStack)
        and type(body).__call__ is LayerStack.__call__
    ):
        return body.stepwise(tokens, caches)
    return model.forward(tokens, caches)


def keeps_on_the_way(caches: Sequence[object]) -> bool:
    """Whether every layer can give its state at a point a chunk went past: it rewinds
    there (plain, quantized and latent KV, not a sliding window's), or it is recurrent
    and keeps the states asked for (`RecurrentCache.capture`)."""
    return all(isinstance(c, (RecurrentCache, KVCache, QuantizedKVCache)) for c in caches)
