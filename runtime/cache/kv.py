"""A growing key/value cache for full-attention layers, plus the mask helpers both caches share."""

from __future__ import annotations

from typing import Literal, TypeAlias

import mlx.core as mx

# What attention receives: None (attend to every key), "causal" (lower-right aligned causal,
# done inside the fused kernel), or a boolean array broadcastable to (B, H, L, K), True = attend.
Mask: TypeAlias = mx.array | Literal["causal"] | None


def window_mask(queries: int, keys: int, window: int | None) -> mx.array:
    """Boolean (queries, keys) mask; the queries are the last `queries` of the `keys` positions.

    Query i sits at key position ``keys - queries + i``; it sees key j when j is not in its
    future and, with a window, when fewer than `window` positions separate them (a query sees
    itself plus window - 1 earlier tokens, as transformers' sliding masks do).
    """
    q_pos = mx.arange(keys - queries, keys)[:, None]
    k_pos = mx.arange(keys)[None, :]
    distance = q_pos - k_pos
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    return allowed


class KVCache:
    """Keys and values of every token seen, in a buffer that grows `step` tokens at a time.

    Writing into a preallocated buffer by slice assignment keeps single-token decode from
    copying the whole cache each step, as concatenation would.
    """

    def __init__(self, step: int = 256) -> None:
        self.step = step
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._offset = 0

    @property
    def offset(self) -> int:
        """Tokens seen (and held) so far; the position of the next token."""
        return self._offset

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        capacity = ((needed + self.step - 1) // self.step) * self.step
        batch, heads, _, k_dim = keys.shape
        new_k = mx.zeros((batch, heads, capacity, k_dim), dtype=keys.dtype)
        new_v = mx.zeros((batch, heads, capacity, values.shape[-1]), dtype=values.dtype)
        if self.keys is not None and self.values is not None and self._offset > 0:
            new_k[..., : self._offset, :] = self.keys[..., : self._offset, :]
            new_v[..., : self._offset, :] = self.values[..., : self._offset, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (B, n_kv_heads, L, head_dim) keys/values; return all held so far."""
        start = self._offset
        end = start + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        assert self.keys is not None and self.values is not None
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self._offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        """The mask for the next `update_and_fetch` of `length` tokens.

        `window` limits how far back a query looks (a sliding-window layer served by a cache
        that keeps everything); without it the mask is plain causal.
        """
        total = self._offset + length
        if window is None or total <= window:
            return None if length == 1 else "causal"
        return window_mask(length, total, window)

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate after a prefill chunk (the whole buffers)."""
        if self.keys is None or self.values is None:
            return []
        return [self.keys, self.values]

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (at most all of them); return how many were dropped."""
        n = max(0, min(n, self._offset))
        self._offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers (capacity, not just the tokens held)."""
        if self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)
