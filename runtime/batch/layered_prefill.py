"""A prompt's chunk read a few layers per step, between the running batch's decode steps.

On a CPU a matrix product of a few dozen rows runs well below the BLAS's speed on a few
hundred (likely because the weights are packed again on every call). A chunk
that rides on a decode step (runtime/cache/ragged.py) must stay that small for the step
to stay short, and its tokens then cost more than they do alone. Measured on
Qwen2.5-Coder-0.5B at 8k tokens of context, float32, OpenBLAS, 2 cores (one token's
share of all 24 layers):

    a 32-token chunk riding on 4 rows' decode step    13.7 ms a token
    a 64-token one                                    11.5 ms
    a 2048-token chunk alone                          10.5 ms
    256-512 tokens through 1-2 layers                  8.4-9.2 ms

So while sequences decode, the scheduler reads a long prompt (more than
`LayerPace.min_prompt` tokens left) in chunks of a few hundred tokens, a few layers per
step: the chunk's hidden states wait between steps, and each layer's cache takes the
chunk as it passes. The streams wait for a step
of a few layers, and the prompt's tokens cost what they cost in a long chunk.

Only for bodies that are a plain stack (runtime/models/decoder.py's LayerStack: embed,
then each layer as `layer(h, cache)`) over growing KV caches: a layer's cache then
rewinds (a chunk given up halfway is trimmed from the layers it passed) and gives its
state at any point (the trie's snapshot points inside a chunk cost nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from runtime.batch.prompt_prefill import PromptPrefill
from runtime.cache import KVCache, QuantizedKVCache
from runtime.models.decoder import LayerStack


def layer_stack(model: Any) -> LayerStack | None:
    """`model`'s body, if its prompts can be read a few layers at a time (see above)."""
    body = getattr(model, "model", None)
    if not isinstance(body, LayerStack) or type(body).__call__ is not LayerStack.__call__:
        return None
    kinds = (KVCache, QuantizedKVCache)  # growing KV caches, plain or quantized
    return body if all(type(c) in kinds for c in model.make_caches()) else None


class LayeredChunk:
    """One chunk of a prompt on its way through the layers."""

    def __init__(
        self, body: LayerStack, prefill: PromptPrefill, tokens: int,
        on_pause: Callable[[int], None],
    ) -> None:  # fmt: skip
        self.body = body
        self.per_step = 0  # layers a step takes it through while others decode (LayerPace.fit)
        self.prefill = prefill
        self.inside = prefill.take_inside(tokens)  # snapshot points recorded at the end
        self.tokens = prefill.plan(tokens, on_pause)
        self.next = 0  # the first layer the chunk has not been through
        self.hidden: mx.array | None = None
        if self.tokens > 0:
            ids = mx.array(prefill.rest[: self.tokens], dtype=mx.int32)[None]
            self.hidden = body.embed_tokens(ids)

    @property
    def left(self) -> int:
        """Layers still to go."""
        return 0 if self.tokens <= 0 else len(self.body.layers) - self.next

    @property
    def done(self) -> bool:
        return self.left == 0

    def run(self, layers: int) -> None:
        """Take the chunk through up to `layers` more layers (evaluated: the step ends here)."""
        end = min(len(self.body.layers), self.next + max(1, layers))
        caches = self.prefill.caches[self.next : end]
        h = self.hidden
        assert h is not None
        for layer, cache in zip(self.body.layers[self.next : end], caches, strict=True):
            h = layer(h, cache)
        handed: list[mx.array] = []
        sink = self.prefill.hidden_to  # the last layer's output, normed (PromptPrefill)
        if sink is not None and end == len(self.body.layers):
            handed = sink(self.prefill.offset, self.body.norm(h)[0])
        mx.eval(h, [a for c in caches for a in c.state], handed)
        self.hidden, self.next = h, end

    def finish(self, on_pause: Callable[[int], None]) -> None:
        """Every layer took the chunk: the prompt moves on past it."""
        for at in self.inside:
            on_pause(at)
        self.hidden = None
        self.prefill.advance(self.tokens, on_pause)

    def undo(self) -> None:
        """Given up halfway (the request was cancelled): the layers it went through forget
        it, so that the caches hold the prompt up to the chunk, as every layer agrees."""
        for cache in self.prefill.caches[: self.next]:
            cache.trim(self.tokens)
        self.hidden, self.next = None, 0


# While sequences decode, a prompt is read in chunks of about LAYERED_CHUNK tokens, each
# step taking about LAYERED_SHARE decode steps: the number of layers per step, and the
# chunk's tokens so that a whole number of layers fills a step, come from the measured
# time of a token through a layer. Fewer tokens than MIN_LAYERED_CHUNK would bring the
# small products' cost back; before anything is measured, FIRST_LAYERED_CHUNK tokens go
# one layer at a time.
LAYERED_SHARE = 3.0
LAYERED_CHUNK = 384
MIN_LAYERED_CHUNK = 128
FIRST_LAYERED_CHUNK = 256
_EMA = 0.3  # weight of the newest measurement in a running average


def running_average(old: float, new: float) -> float:
    """`new` folded into the running average `old` (`new` itself when there is none)."""
    return new if old <= 0 else (1 - _EMA) * old + _EMA * new


class LayerPace:
    """Sizes layered chunks from the decode step's time and a token's time through a layer."""

    def __init__(self) -> None:
        self.seconds = 0.0  # one token through one layer (the step's decode step aside)
        # a prompt goes layer by layer while more than this many of its tokens are left;
        # a shorter one rides on the decode steps (one read of the weights for both)
        self.min_prompt = LAYERED_CHUNK

    def tokens(self, cap: int, step: float, layers: int) -> int:
        """A new chunk's tokens, at most `cap`, for a model of `layers` layers; `step`: a
        plain decode step's seconds. About LAYERED_CHUNK: the layers that many tokens
        need a step for, split into steps as equal as the count allows (24 layers, 5 a
        step: 4 steps of 6), then the tokens that fill a step of that many layers."""
        if self.seconds <= 0:
            return min(cap, FIRST_LAYERED_CHUNK)
        budget = (LAYERED_SHARE - 1) * step
        need = max(1, min(layers, math.ceil(budget / (LAYERED_CHUNK * self.seconds))))
        per_step = math.ceil(layers / max(1, layers // need))
        tokens = int(budget / (per_step * self.seconds))
        return max(min(cap, MIN_LAYERED_CHUNK), min(cap, tokens))

    def fit(self, tokens: int, step: float, layers: int) -> int:
        """Layers per step for a chunk of `tokens` tokens, the same for all its steps (so
        that they take the same time): as many as fit in a step, in steps as equal as the
        count allows. 0 before anything is measured (a step then takes one)."""
        if self.seconds <= 0:
            return 0
        budget = (LAYERED_SHARE - 1) * step
        fits = max(1, min(layers, int(budget / (max(1, tokens) * self.seconds))))
        return math.ceil(layers / math.ceil(layers / fits))

    def measured(self, token_layers: int, own: float) -> None:
        """`token_layers` (tokens times layers) took `own` seconds."""
        if token_layers > 0 and own > 0:
            self.seconds = running_average(self.seconds, own / token_layers)
