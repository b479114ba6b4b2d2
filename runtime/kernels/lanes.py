"""Quantized weights in 16-feature lanes: the CPU's decode layout for 4- to 8-bit weights.

runtime/kernels/qlanes.c multiplies a vector of 16 features at a time (one output per
lane; qlanes2.c, on AVX2, two vectors of 8), which needs each 32-byte chunk of a weight
to hold 16 features' int16 pairs once widened. `to_lanes` permutes mx.quantize's bytes into that order at load
(runtime/models/linear.py `use_lanes`); nothing is re-rounded, and `to_standard` gives
the same bytes back. The arrays say which layout they are in by their rank:

    standard: w uint32 [N, K * bits / 32], scales and biases [N, K / group_size]
    lanes:    w int32 [N / 16, K * bits / 32, 16], scales and biases [N / 16, K / group_size, 16]

(the int32 tells a lanes weight from a batch of standard ones, which MLX allows), so a
lanes weight that reaches one of MLX's own ops fails instead of multiplying the wrong
numbers. Inside a strip of 16 features, block b of 32 weights is
64 * bits bytes: 32-byte chunks c, whose bytes 2j and 2j + 1 belong to feature j. At 8
bits they are weights 2c and 2c + 1; at 4 to 6 bits, 8 chunks where byte 2j + t holds
weight 4c + t in its low half and 4c + 2 + t in its high half (the low 4 bits), then a
plane of 16 32-bit masks per further bit, mask 2c + h holding weights 4c + 2h + t at bit
2j + t.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

LANES = 16
BITS = (4, 5, 6, 8)
_NIBBLES = 256  # bytes of a strip block's low halves


def fits(w: mx.array, scales: mx.array, bits: int, group_size: int) -> bool:
    """Whether a standard weight can go to lanes: 4 or 8 bits, features a multiple of
    16, groups of whole blocks of 32."""
    if w.ndim != 2 or scales.ndim != 2 or bits not in BITS or group_size % 32:
        return False
    features, depth = w.shape[0], w.shape[1] * 32 // bits
    return features % LANES == 0 and depth % group_size == 0 and depth >= group_size


def in_lanes(w: mx.array) -> bool:
    return w.ndim == 3 and w.dtype == mx.int32


def _numpy(a: mx.array) -> np.ndarray:
    """The array's elements as unsigned integers of its width (numpy has no bfloat16)."""
    view = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.itemsize]
    return np.array(a.view(view) if a.dtype != view else a)


def _back(values: np.ndarray, like: mx.array) -> mx.array:
    out = mx.array(values)
    return out.view(like.dtype) if out.dtype != like.dtype else out


def _groups_to_lanes(a: mx.array) -> mx.array:
    n, groups = a.shape
    values = _numpy(a).reshape(n // LANES, LANES, groups).transpose(0, 2, 1)
    return _back(np.ascontiguousarray(values), a)


def _groups_to_standard(a: mx.array) -> mx.array:
    strips, groups, _ = a.shape
    values = _numpy(a).transpose(0, 2, 1).reshape(strips * LANES, groups)
    return _back(np.ascontiguousarray(values), a)


def to_lanes(
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    bits: int,
    *,
    ext: Any = None,
    threads: int = 1,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """A standard weight's arrays in lanes (`fits` must hold). With the MLX extension
    (`ext`) the bytes are permuted in C on `threads` threads (qlanes.c; a 7B model's
    weights in a second, where numpy's bit planes took 13 s); the numpy below is the
    same permutation (tests/runtime/kernels/test_lanes.py holds the two equal)."""
    n, words = w.shape
    blocks = words * 32 // bits // 32
    raw = _numpy(w).view(np.uint8)
    if ext is not None:
        out = np.empty_like(raw)
        if ext.lanes_from_standard(raw, out, n, blocks * 32, bits, threads):
            return (
                mx.array(out.view(np.int32).reshape(n // LANES, words, LANES)),
                _groups_to_lanes(scales),
                None if biases is None else _groups_to_lanes(biases),
            )
    if bits in (5, 6):
        lanes = _planes_to_lanes(raw, bits, blocks)
        return (
            mx.array(lanes.view(np.int32).reshape(n // LANES, words, LANES)),
            _groups_to_lanes(scales),
            None if biases is None else _groups_to_lanes(biases),
        )
    if bits == 8:  # (strip, feature, block, chunk, t) -> (strip, block, chunk, feature, t)
        out = raw.reshape(n // LANES, LANES, blocks, 16, 2)
    else:
        out = _swap_nibbles(raw.reshape(n // LANES, LANES, blocks, 8, 2))
    lanes = np.ascontiguousarray(out.transpose(0, 2, 3, 1, 4)).reshape(n // LANES, -1)
    return (
        mx.array(lanes.view(np.int32).reshape(n // LANES, words, LANES)),
        _groups_to_lanes(scales),
        None if biases is None else _groups_to_lanes(biases),
    )


def to_standard(
    w: mx.array, scales: mx.array, biases: mx.array | None, bits: int
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The standard arrays of a weight in lanes: the bytes `to_lanes` was given."""
    strips, words, _ = w.shape
    blocks = words * 32 // bits // 32
    raw = _numpy(w).view(np.uint8)
    if bits in (5, 6):
        standard = _planes_to_standard(raw.reshape(strips, blocks, -1), bits)
        return (
            mx.array(standard.view(np.uint32)),
            _groups_to_standard(scales),
            None if biases is None else _groups_to_standard(biases),
        )
    chunks = 16 if bits == 8 else 8
    out = raw.reshape(strips, blocks, chunks, LANES, 2).transpose(0, 3, 1, 2, 4)
    if bits == 4:
        out = _swap_nibbles(out)
    standard = np.ascontiguousarray(out).reshape(strips * LANES, -1).view(np.uint32)
    return (
        mx.array(standard),
        _groups_to_standard(scales),
        None if biases is None else _groups_to_standard(biases),
    )


def _swap_nibbles(pairs: np.ndarray) -> np.ndarray:
    """Byte pairs (last axis) between the two 4-bit orders, either way: standard bytes
    2c, 2c + 1 (weights 4c, 4c + 1 | 4c + 2, 4c + 3) and lanes bytes t = 0, 1 (weights
    4c + t | 4c + 2 + t). The map is its own inverse."""
    a, b = pairs[..., 0], pairs[..., 1]
    return np.stack([(a & 15) | ((b & 15) << 4), (a >> 4) | (b & 0xF0)], axis=-1)


def _values(raw: np.ndarray, bits: int) -> np.ndarray:
    """[N, K] values of standard rows: value i at bits i * bits of each row's stream."""
    stream = np.unpackbits(raw, axis=1, bitorder="little")
    per = stream.reshape(raw.shape[0], -1, bits).astype(np.uint8)
    return (per << np.arange(bits, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)


def _standard_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """`_values`'s inverse: [N, K * bits / 8] bytes."""
    planes = (values[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(values.shape[0], -1), axis=1, bitorder="little")


def _planes_to_lanes(raw: np.ndarray, bits: int, blocks: int) -> np.ndarray:
    """5- and 6-bit standard rows as lanes bytes: [N / 16, blocks * 64 * bits]."""
    q = _values(raw, bits)
    n = q.shape[0]
    nibbles = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)  # 4-bit standard bytes
    low = _swap_nibbles(nibbles.reshape(n // LANES, LANES, blocks, 8, 2))
    parts = [low.transpose(0, 2, 3, 1, 4).reshape(n // LANES, blocks, _NIBBLES)]
    for p in range(bits - 4):
        bit = ((q >> (4 + p)) & 1).reshape(n // LANES, LANES, blocks, 8, 2, 2)
        masks = bit.transpose(0, 2, 3, 4, 1, 5).reshape(n // LANES, blocks, 16, 32)
        parts.append(np.packbits(masks, axis=-1, bitorder="little").reshape(n // LANES, blocks, 64))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(n // LANES, -1)


def _planes_to_standard(raw: np.ndarray, bits: int) -> np.ndarray:
    """`_planes_to_lanes`'s inverse, from [N / 16, blocks, 64 * bits] bytes."""
    strips, blocks, _ = raw.shape
    low = raw[..., :_NIBBLES].reshape(strips, blocks, 8, LANES, 2).transpose(0, 3, 1, 2, 4)
    nib = _swap_nibbles(low).reshape(strips * LANES, -1)
    q = np.empty((strips * LANES, nib.shape[1] * 2), dtype=np.uint8)
    q[:, 0::2], q[:, 1::2] = nib & 15, nib >> 4
    for p in range(bits - 4):
        plane = raw[..., _NIBBLES + 64 * p : _NIBBLES + 64 * (p + 1)].reshape(strips, blocks, 16, 4)
        bit = np.unpackbits(plane, axis=-1, bitorder="little").reshape(
            strips, blocks, 8, 2, LANES, 2
        )
        q |= bit.transpose(0, 4, 1, 2, 3, 5).reshape(strips * LANES, -1) << (4 + p)
    return _standard_rows(q, bits)


def rows(
    w: mx.array, scales: mx.array, biases: mx.array | None, ids: mx.array, bits: int
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The standard arrays of rows `ids` (flat) of a 4- or 8-bit weight in lanes, as MLX
    ops (lazy: an embedding lookup inside a step's graph). Each row's bytes are gathered
    from its strip: [len(ids), K * bits / 32] words and [len(ids), groups] scales."""
    strips = w.shape[0]
    strip, lane = ids // LANES, (ids % LANES).reshape(-1, 1, 1, 1)
    raw = w.view(mx.uint8).reshape(strips, -1, LANES, 2)[strip]  # (n, chunks, 16, 2)
    picked = mx.take_along_axis(raw, lane, axis=2)[:, :, 0, :]  # (n, chunks, 2)
    if bits == 4:  # chunk c's two bytes -> standard bytes 2c, 2c + 1
        l0, l1 = picked[..., 0], picked[..., 1]
        picked = mx.stack([(l0 & 15) | ((l1 & 15) << 4), (l0 >> 4) | (l1 & 0xF0)], axis=-1)
    standard = picked.reshape(ids.size, -1).view(mx.uint32)

    def groups(a: mx.array) -> mx.array:
        return mx.take_along_axis(a[strip], lane[:, :, :, 0], axis=2)[..., 0]

    return standard, groups(scales), None if biases is None else groups(biases)
