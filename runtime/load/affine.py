"""Float weights -> MLX affine (weight, scales, biases) triplets at load: `--quantize`,
the GGUF types with no exact affine form (Q6_K, Q2_K, Q3_K, IQ*), and FP8 checkpoints.

Each group of ``group_size`` values along the last axis gets the min-max grid: bias = the
group's minimum, scale = its range / (2**bits - 1), every value rounded to the nearest
level (error at most half a step). When scales and biases are stored in a narrower dtype
than float32, the bias is rounded down and the scale up in that dtype before the values
are rounded, so the stored grid still covers the group and each value goes to the
nearest level of the grid actually stored (casting mx.quantize's float32 scales to float16
afterwards instead shifts every value of a group together: on Qwen2.5-Coder-0.5B's Q6_K
tensors that raised the relative RMS error of an 8-bit requantization from 4.84e-3 to
4.93e-3; this grid with float16 scales gives 4.76e-3).

Bits 2, 4 and 8 are packed here (a value never straddles a uint32); other widths go
through mx.quantize (MLX's grid, which keeps zero exact) with scales cast afterwards.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

PACKED_BITS = (2, 4, 8)
_SIGN_16 = 15  # float16 and bfloat16: the sign is bit 15


def affine_quantize(
    w: mx.array, *, group_size: int, bits: int, scales_dtype: mx.Dtype
) -> tuple[mx.array, mx.array, mx.array]:
    """``w`` (..., n) as MLX affine ``bits``-bit triplets, scales/biases in ``scales_dtype``
    (lazy; the caller evaluates). ``n`` must be a multiple of ``group_size``."""
    if w.shape[-1] % group_size:
        raise ValueError(f"width {w.shape[-1]} is not a multiple of the group size {group_size}")
    if bits not in PACKED_BITS:
        q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        return q, scales.astype(scales_dtype), biases.astype(scales_dtype)
    levels = (1 << bits) - 1
    x = w.astype(mx.float32).reshape(*w.shape[:-1], -1, group_size)
    low, high = x.min(axis=-1), x.max(axis=-1)
    bias = _rounded(low, scales_dtype, up=False)
    span = high - bias.astype(mx.float32)
    # a constant group: any positive scale (q = 0 everywhere)
    scale = _rounded(mx.where(span > 0, span / levels, 1.0), scales_dtype, up=True)
    step = scale.astype(mx.float32)[..., None]
    q = mx.clip(mx.round((x - bias.astype(mx.float32)[..., None]) / step), 0, levels)
    return _pack(q.astype(mx.uint32).reshape(w.shape), bits), scale, bias


def _rounded(x: mx.array, dtype: mx.Dtype, *, up: bool) -> mx.array:
    """float32 ``x`` in ``dtype``, rounded up (toward +inf) or down instead of to nearest."""
    if dtype == mx.float32:
        return x
    if dtype not in (mx.float16, mx.bfloat16):
        raise ValueError(f"scales must be float32, float16 or bfloat16, not {dtype}")
    near = x.astype(dtype)
    back = near.astype(mx.float32)
    wrong = back < x if up else back > x
    # the next value in the wanted direction is the neighbouring bit pattern: one more
    # (larger magnitude) when moving away from zero, one less when moving toward it
    pattern = near.view(mx.uint16)
    negative = (pattern >> _SIGN_16) == 1
    away = negative != up
    one = mx.array(1, dtype=mx.uint16)
    neighbour = mx.where(away, pattern + one, pattern - one).view(dtype)
    return mx.where(wrong, neighbour, near)


def _pack(q: mx.array, bits: int) -> mx.array:
    """Small unsigned ints (..., n) -> MLX's little-endian bit stream in uint32 words."""
    per_word = 32 // bits
    words = q.reshape(*q.shape[:-1], -1, per_word)
    shifts = mx.arange(per_word, dtype=mx.uint32) * bits
    return mx.sum(words << shifts, axis=-1).astype(mx.uint32)


def float16_exact(*arrays: np.ndarray) -> bool:
    """Whether every value of ``arrays`` (float32) is a float16 value, i.e. storing them
    as float16 loses nothing."""
    for a in arrays:
        with np.errstate(over="ignore"):
            if not np.array_equal(a.astype(np.float16).astype(np.float32), a):
                return False
    return True
