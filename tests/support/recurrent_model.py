"""A tiny random MLX model mixing full attention, sliding-window attention and a toy
recurrent layer, so the prefix cache can be driven through every cache type.

The recurrent layer folds every token into a decaying state that its output reads, so a
state restored from the wrong offset (or not restored) changes the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.nn.layers.activations import silu
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear

from runtime.cache import KVCache, LayerCache, RecurrentCache, RotatingKVCache
from runtime.models.base import MLP, Attention, RMSNorm
from runtime.models.rope import RoPE, RopeSpec

FULL = "full"
SLIDING = "sliding"
RECURRENT = "recurrent"


class ToyRecurrent(Module):
    """A causal conv over the last `kernel` projected inputs, then a per-channel state
    h_t = decay * h_{t-1} + silu(conv_t); the output is a projection of h."""

    def __init__(self, dims: int, width: int, kernel: int = 3) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_proj = Linear(dims, width)
        self.conv_weight = mx.random.normal((kernel, width)) * 0.5
        self.decay = mx.random.uniform(0.7, 0.98, (width,))
        self.out_proj = Linear(width, dims)

    def __call__(self, x: mx.array, cache: RecurrentCache) -> mx.array:
        batch, length, _ = x.shape
        u = self.in_proj(x)
        width = u.shape[-1]
        tail = cache.conv_state
        if tail is None:
            tail = mx.zeros((batch, self.kernel - 1, width), dtype=u.dtype)
        seq = mx.concatenate([tail, u], axis=1)
        conv = seq[:, 0:length] * self.conv_weight[0]
        for j in range(1, self.kernel):
            conv = conv + seq[:, j : j + length] * self.conv_weight[j]
        v = silu(conv)
        h0 = cache.recurrent_state
        if h0 is None:
            h0 = mx.zeros((batch, width), dtype=u.dtype)
        # h_t = decay^(t+1) h0 + sum_{s<=t} decay^(t-s) v_s, as one weighted sum
        t = mx.arange(length)
        gap = (t[:, None] - t[None, :]).astype(mx.float32)[..., None]  # (L, L, 1)
        weights = mx.where(gap >= 0, mx.power(self.decay, mx.maximum(gap, 0.0)), 0.0)
        h = (weights[None] * v[:, None, :, :]).sum(axis=2)
        carry = mx.power(self.decay, (t + 1).astype(mx.float32)[:, None])  # (L, W)
        h = h + carry[None] * h0[:, None, :]
        cache.update(seq[:, -(self.kernel - 1) :], h[:, -1], length)
        return self.out_proj(h)


class _Block(Module):
    def __init__(self, kind: str, dims: int, head_dim: int, window: int, rope: RoPE) -> None:
        super().__init__()
        self.kind = kind
        self.norm1 = RMSNorm(dims)
        self.norm2 = RMSNorm(dims)
        self.mixer: Module
        if kind == RECURRENT:
            self.mixer = ToyRecurrent(dims, 2 * dims)
        else:
            sliding = window if kind == SLIDING else None
            self.mixer = Attention(dims, 2, 1, head_dim, rope, window=sliding)
        self.mlp = MLP(dims, 2 * dims)

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        h = x + self.mixer(self.norm1(x), cache)
        return h + self.mlp(self.norm2(h))


class HybridModel(Module):
    """forward / logits / make_caches, as runtime models have."""

    def __init__(
        self,
        kinds: Sequence[str],
        *,
        vocab: int = 256,
        dims: int = 32,
        head_dim: int = 16,
        window: int = 6,
        seed: int = 0,
    ) -> None:
        super().__init__()
        mx.random.seed(seed)
        self.kinds = tuple(kinds)
        self.window = window
        rope = RoPE(RopeSpec(), head_dim)
        self.embed = Embedding(vocab, dims)
        self.layers = [_Block(kind, dims, head_dim, window, rope) for kind in kinds]
        self.norm = RMSNorm(dims)
        mx.eval(self.parameters())

    def forward(self, tokens: mx.array, caches: Sequence[Any]) -> mx.array:
        h = self.embed(tokens)
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, cache)
        return self.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.embed.as_linear(hidden)

    def make_caches(self) -> list[LayerCache]:
        caches: list[LayerCache] = []
        for kind in self.kinds:
            if kind == RECURRENT:
                caches.append(RecurrentCache())
            elif kind == SLIDING:
                caches.append(RotatingKVCache(self.window))
            else:
                caches.append(KVCache(step=16))
        return caches
