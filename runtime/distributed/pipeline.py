"""Pipeline parallelism: contiguous stages of layers, one per rank, activations passed on.

Rank r holds layers [a, b) (stages balanced by parameter bytes, each at least one layer).
Every rank runs the same forward call on the same tokens:

- rank 0 embeds the tokens; every later rank receives the residual stream from rank
  r - 1 (mx.distributed.recv) in place of its own stage input;
- each rank runs its layers over its caches (only its layers have caches: `make_caches`
  returns its stage's, so the memory of the others' caches is never spent);
- every rank but the last sends its output to rank r + 1. Sends and receives are
  queued at once (mx.async_eval): a caller that only evaluates its caches after a
  prefill chunk would otherwise never send, and rank r + 1 would wait forever; and a
  forward built but never evaluated still moves its activations, so the next forward's
  receive cannot read the previous one's;
- the last rank applies the final norm and the result is broadcast (an all_sum to
  which the other ranks add zeros), so `forward` returns the same hidden states, and
  `logits` the same logits, on every rank. Hidden states, not logits, travel: the
  vocabulary is far wider than the hidden size, so every rank keeps the LM head.

Every rank must evaluate the same outputs of `forward` (the engine runs in lockstep): the
final broadcast is a collective, which a rank that skips it leaves its peers waiting in.
The layers are wrapped (`StageLayer`), so every path through the body (plain forward,
batched decode, fused ragged steps, the vision models' image chunks) goes through them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.utils import tree_flatten

from runtime.cache import Cache
from runtime.models.base import LanguageModel


def stage_ranges(costs: Sequence[int], size: int) -> list[range]:
    """Split layers of the given `costs` into `size` contiguous, non-empty stages whose
    largest total is as small as it can be (ties: earlier stages smaller)."""
    count = len(costs)
    if size < 1:
        raise ValueError(f"a group has at least one rank, not {size}")
    if count < size:
        raise ValueError(
            f"{count} layers cannot form {size} pipeline stages: use at most {count} ranks"
        )
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[k][i]: the smallest largest-stage cost of the first i layers in k stages
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(size + 1)]
    cut = [[0] * (count + 1) for _ in range(size + 1)]
    best[0][0] = 0
    for k in range(1, size + 1):
        for i in range(k, count - (size - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [count]
    for k in range(size, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(size)]


def parameter_bytes(module: Module | LanguageModel) -> int:
    """Bytes of a module's parameters (known from shapes: nothing is evaluated)."""
    arrays = tree_flatten(module.parameters())
    return sum(int(value.nbytes) for _, value in cast(list[tuple[str, mx.array]], arrays))


class StageLayer(Module):
    """One layer of this rank's stage. The stage's first layer (`source` set) takes the
    residual stream from rank `source` instead of its own input; its last (`target`
    set) sends its output to rank `target`. Attribute lookups it does not answer go to
    the layer, so code that inspects layers (`fusable`) sees the layer itself."""

    def __init__(
        self,
        layer: Module,
        group: mx.distributed.Group,
        dtype: mx.Dtype,
        *,
        source: int | None = None,
        target: int | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self._group, self._dtype = group, dtype
        self._source, self._target = source, target

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            layer = self.get("layer")
            if layer is None:
                raise
            return getattr(layer, key)

    def __call__(self, h: mx.array, cache: Any, *args: Any, **kwargs: Any) -> mx.array:
        if self._source is not None:
            h = mx.distributed.recv(h.shape, self._dtype, self._source, group=self._group)
            mx.async_eval(h)
        out: mx.array = self.layer(h, cache, *args, **kwargs)
        if self._target is not None:
            out = mx.distributed.send(out.astype(self._dtype), self._target, group=self._group)
            mx.async_eval(out)
        return out


class BroadcastNorm(Module):
    """The final norm, applied on the last rank and broadcast to all: every rank adds
    its part to one all_sum, the last rank its normed hidden states, the others zeros
    (made to wait on their stage's send, which must not be overtaken)."""

    def __init__(
        self, norm: Module, group: mx.distributed.Group, dtype: mx.Dtype, *, last: bool
    ) -> None:
        super().__init__()
        self.norm = norm
        self._group, self._dtype, self._last = group, dtype, last

    def __call__(self, h: mx.array) -> mx.array:
        if self._last:
            part = self.norm(h).astype(self._dtype)
        else:
            part = mx.depends(mx.zeros(h.shape, self._dtype), h)
        return mx.distributed.all_sum(part, group=self._group)


class StageInput(Module):
    """Stands in for the token embeddings on a rank past the first whose LM head is its
    own (untied): its stage input comes from the previous rank, so only the shape of
    the embeddings matters, and the embedding table is never loaded there."""

    def __init__(self, dims: int, dtype: mx.Dtype) -> None:
        super().__init__()
        self._dims, self._dtype = dims, dtype

    def __call__(self, tokens: mx.array) -> mx.array:
        return mx.zeros((*tokens.shape, self._dims), self._dtype)


def _stage_caches(model: Any, stage: range) -> Callable[[], list[Cache]]:
    """`model.make_caches` cut to the stage. The model is held weakly: as an attribute
    of the model, a strong reference would make a cycle only the GC could free."""
    make = type(model).make_caches
    owner = weakref.ref(model)

    def make_caches() -> list[Cache]:
        """The caches of this rank's stage only (a fresh cache holds no memory yet)."""
        held = owner()
        if held is None:
            raise ReferenceError("the model these caches were for is gone")
        caches: list[Cache] = make(held)
        return caches[stage.start : stage.stop]

    return make_caches


def shard_pipeline(model: Any, group: mx.distributed.Group) -> range:
    """Keep this rank's stage of `model`'s layers, wire the sends and receives, and make
    `make_caches` return the stage's caches; returns the stage (global layer indices)."""
    body = model.model
    layers = list(body.layers)
    size, rank = group.size(), group.rank()
    stage = stage_ranges([parameter_bytes(layer) for layer in layers], size)[rank]
    # the residual stream's width and dtype (the loader cast every float weight to it)
    hidden, dtype = int(body.norm.weight.shape[0]), body.norm.weight.dtype
    body.layers = [
        StageLayer(
            layers[i],
            group,
            dtype,
            source=rank - 1 if i == stage.start and rank > 0 else None,
            target=rank + 1 if i == stage.stop - 1 and rank < size - 1 else None,
        )
        for i in stage
    ]
    body.norm = BroadcastNorm(body.norm, group, dtype, last=rank == size - 1)
    if rank > 0 and getattr(model, "lm_head", None) is not None:
        body.embed_tokens = StageInput(hidden, dtype)
    # an instance attribute: this model's caches only, whatever its class makes
    model.make_caches = _stage_caches(model, stage)
    return stage


__all__ = [
    "BroadcastNorm",
    "StageInput",
    "StageLayer",
    "parameter_bytes",
    "shard_pipeline",
    "stage_ranges",
]
