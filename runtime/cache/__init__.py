"""Per-layer attention caches and the protocol the models program against."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from runtime.cache.kv import KVCache, Mask, window_mask
from runtime.cache.rotating import RotatingKVCache


class Cache(Protocol):
    """What an attention layer needs from its cache."""

    @property
    def offset(self) -> int:
        """Tokens seen so far: the position of the next token."""
        ...

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add (B, n_kv_heads, L, head_dim) keys/values; return the ones to attend to."""
        ...

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        """The attention mask for the next update of `length` tokens (call before it)."""
        ...

    @property
    def state(self) -> list[mx.array]:
        """The arrays to mx.eval after a prefill chunk."""
        ...

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens where possible; return how many were dropped."""
        ...

    @property
    def nbytes(self) -> int: ...


__all__ = ["Cache", "KVCache", "Mask", "RotatingKVCache", "window_mask"]
