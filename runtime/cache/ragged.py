"""One layer's caches for a fused step: the running batch's decode tokens and a prefill
chunk in one forward.

On a CPU a forward's fixed cost is reading the weights, about one decode step. A decode
step and a prefill chunk run as two forwards pay it twice; run as one, the chunk's rows
and the batch's ride on the same weight reads, so the running streams wait only for the
chunk's own compute. The model sees one row of `B + n` tokens: the B decode tokens,
then the chunk's n. Every per-token layer (norms, projections, MLPs, experts) works on
them together; attention splits them (`split`), each part over its own cache, and joins
the outputs back (`join`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class RaggedCache:
    """`decode`: the batch's cache of one layer (B rows, one new token each); `prefill`:
    the prefill's cache of the same layer (one row, a chunk of n tokens)."""

    def __init__(self, decode: Any, prefill: Any) -> None:
        self.decode = decode
        self.prefill = prefill
        self.rows = int(decode.rows)

    def split(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(1, B + n, ...) -> the decode part (B, 1, ...) and the chunk (1, n, ...)."""
        return mx.expand_dims(x[0, : self.rows], 1), x[:, self.rows :]

    def join(self, decoded: mx.array, chunk: mx.array) -> mx.array:
        """(B, 1, F) and (1, n, F) -> (1, B + n, F), in the order `split` took them."""
        return mx.concatenate([decoded.reshape(1, self.rows, -1), chunk], axis=1)
