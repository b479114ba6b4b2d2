"""Attention masks shared by the caches."""

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
