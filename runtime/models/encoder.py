"""What every encoder architecture (runtime/models/bert.py) offers the encoder runner
(runtime/engine/encoder.py): a bidirectional forward over a left-padded batch, and, for a
cross-encoder, its classification head.

Batches are padded on the left: each row's tokens end at the last column, so the
CPU attention primitive skips a row's padding by its first key (`starts`), and the last
token of every row is the last column.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx.nn.layers.base import Module

from runtime import kernels as cpu_kernels


class EncoderArgs(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def max_positions(self) -> int:
        """Tokens one input may hold (special tokens included)."""
        ...

    @property
    def num_labels(self) -> int:
        """Outputs of the classification head; 0 without one (an embedding model)."""
        ...

    @property
    def pad_token_id(self) -> int: ...
    @property
    def type_vocab_size(self) -> int: ...


class EncoderModel(Protocol):
    """A bidirectional encoder (what `runtime.models.build_encoder` returns)."""

    @property
    def args(self) -> EncoderArgs: ...

    def forward(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> mx.array:
        """(B, L) int32 tokens, row b left-padded by padding[b] -> (B, L, hidden)."""
        ...

    def layers(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> Iterator[mx.array]:
        """`forward` a layer at a time: the (lazy) hidden states after each layer, the
        last one forward's output. The caller may evaluate each before asking for the
        next (runtime/engine/encoder.py runs a piece layer by layer, between other
        engines' steps)."""
        ...

    def classify(self, hidden: mx.array, padding: Sequence[int]) -> mx.array:
        """(B, L, hidden) -> (B, num_labels) logits (a cross-encoder's head)."""
        ...

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]: ...

    def parameters(self) -> Any: ...

    def load_weights(
        self, file_or_weights: str | list[tuple[str, mx.array]], strict: bool = True
    ) -> Module: ...


def key_mask(padding: Sequence[int], length: int) -> mx.array:
    """(B, L) bool: True on each row's tokens, False on its left padding."""
    starts = mx.array(list(padding), dtype=mx.int32)[:, None]
    return mx.arange(length, dtype=mx.int32)[None, :] >= starts


def first_token(hidden: mx.array, padding: Sequence[int]) -> mx.array:
    """(B, L, D) -> (B, D): each row's first token ([CLS] / <s>), past its padding."""
    index = mx.array(list(padding), dtype=mx.int32)[:, None, None]
    return mx.take_along_axis(hidden, index, axis=1)[:, 0]


def attend_padded_runs(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    padding: Sequence[int],
    causal: bool,
) -> mx.array | None:
    """(B, H, L, D) attention of left-padded rows through the CPU attention primitive,
    each run of rows with the same padding without it (it skips padding only before a
    query block, a cache's); the padded queries' outputs are zeros. None where the
    primitive does not run (the caller's MLX attention under a mask then)."""
    if not (cpu_kernels.can_attend(q, k) and v.shape == k.shape):
        return None
    outs = []
    start = 0
    while start < len(padding):
        pad, end = padding[start], start + 1
        while end < len(padding) and padding[end] == pad:
            end += 1
        rows = slice(start, end)
        out = cpu_kernels.attend(
            q[rows, :, pad:], k[rows, :, pad:], v[rows, :, pad:], scale=scale, causal=causal
        )
        if out is None:
            return None
        outs.append(mx.pad(out, [(0, 0), (0, 0), (pad, 0), (0, 0)]) if pad else out)
        start = end
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def bidirectional_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, padding: Sequence[int]
) -> mx.array:
    """(B, H, L, D) queries over the same rows' keys, each row's left padding hidden; the
    padded queries' outputs are garbage (zeros on the CPU) the caller never reads.

    On the CPU each run of rows with the same padding goes through the attention
    primitive without its padding (it skips padding only before a query block, a
    cache's); a piece's rows come longest first, so the runs are few. Elsewhere, or
    without the primitive, MLX's attention under a key mask."""
    out = attend_padded_runs(q, k, v, scale=scale, padding=padding, causal=False)
    if out is not None:
        return out
    if not any(padding):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    keys = key_mask(padding, k.shape[2])[:, None, None, :]
    mask = mx.where(keys, mx.array(0.0, dtype=q.dtype), mx.array(-mx.inf, dtype=q.dtype))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
