"""Rotary position embeddings: reading their config, and applying them with mx.fast.rope.

Configs come in two spellings: transformers < 5 wrote top-level ``rope_theta`` and
``rope_scaling``; transformers 5 writes ``rope_parameters``, which may be nested per
layer type (gemma3: ``{"full_attention": {...}, "sliding_attention": {...}}``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from runtime import kernels as cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding, fully resolved (no defaults left to look up)."""

    rope_type: str = "default"
    theta: float = 10_000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def _rope_dict(config: Mapping[str, Any], layer_type: str | None) -> dict[str, Any]:
    """The rope parameters that apply to `layer_type`, from either config spelling."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        if any(k in params for k in _LAYER_TYPE_KEYS):
            nested = params.get(layer_type or "full_attention")
            return dict(nested) if isinstance(nested, Mapping) else {}
        return dict(params)
    scaling = config.get("rope_scaling")
    return dict(scaling) if isinstance(scaling, Mapping) else {}


def parse_rope(
    config: Mapping[str, Any],
    *,
    layer_type: str | None = None,
    default_theta: float = 10_000.0,
    theta_key: str = "rope_theta",
    apply_old_scaling: bool = True,
) -> RopeSpec:
    """Resolve the rope of `layer_type` from a HF config dict.

    `theta_key` names the old top-level key holding the base (gemma3's local layers use
    ``rope_local_base_freq``). `apply_old_scaling=False` ignores an old-style
    ``rope_scaling`` (gemma3 applies it to global layers only).
    """
    has_new = isinstance(config.get("rope_parameters"), Mapping) and bool(
        config.get("rope_parameters")
    )
    params = _rope_dict(config, layer_type) if (has_new or apply_old_scaling) else {}
    theta = params.get("rope_theta")
    if theta is None:
        theta = config.get(theta_key)
    if theta is None:
        theta = default_theta
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    max_pos = int(config.get("max_position_embeddings") or 8192)

    def opt_float(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    return RopeSpec(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor") or 1.0),
        high_freq_factor=float(params.get("high_freq_factor") or 4.0),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or max_pos
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=opt_float("attention_factor"),
        mscale=opt_float("mscale"),
        mscale_all_dim=opt_float("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _base_inv_freq(theta: float, dims: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    return 1.0 / (theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims))


def _llama3_inv_freq(spec: RopeSpec, dims: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    inv_freq = _base_inv_freq(spec.theta, dims)
    old_ctx = spec.original_max_position_embeddings
    low_wavelen = old_ctx / spec.low_freq_factor
    high_wavelen = old_ctx / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_ctx / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, dims: int) -> tuple[np.ndarray[Any, np.dtype[np.float64]], float]:
    base, factor = spec.theta, spec.factor
    if spec.attention_factor is not None:
        attn = spec.attention_factor
    elif spec.mscale and spec.mscale_all_dim:
        attn = _yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim)
    else:
        attn = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        ctx = spec.original_max_position_embeddings
        return (dims * math.log(ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, attn


class RoPE:
    """Applies one rotary embedding to (B, H, L, D) arrays at a position offset.

    A plain class, not an nn.Module: its frequency table is a constant, not a parameter.
    """

    def __init__(self, spec: RopeSpec, dims: int) -> None:
        self.spec = spec
        self.dims = dims
        self._scale = 1.0
        self._base: float | None = spec.theta
        self._freqs: mx.array | None = None
        self._mscale = 1.0
        self._inv_freq: mx.array | None = None
        if spec.rope_type == "linear":
            self._scale = 1.0 / spec.factor
        elif spec.rope_type in ("llama3", "yarn"):
            if spec.rope_type == "llama3":
                inv_freq = _llama3_inv_freq(spec, dims)
            else:
                inv_freq, self._mscale = _yarn(spec, dims)
            # mx.fast.rope takes per-pair periods (1 / inverse frequency) instead of a base.
            self._freqs = mx.array((1.0 / inv_freq).astype(np.float32))
            self._base = None

    def inv_freq(self) -> mx.array:
        """Each rotated pair's inverse frequency, float32, as mx.fast.rope's CPU fallback
        computes it (the reciprocal of the periods, or exp(-i log(base) / (dims / 2)))."""
        if self._inv_freq is None:
            half = self.dims // 2
            if self._freqs is not None:
                self._inv_freq = mx.reciprocal(self._freqs)
            else:
                step = mx.array(-math.log(self._base or 10000.0) / half, dtype=mx.float32)
                self._inv_freq = mx.exp(mx.arange(half, dtype=mx.float32) * step)
            mx.eval(self._inv_freq)
        return self._inv_freq

    def kernel_args(self) -> tuple[int, float, float] | None:
        """(dims, scale, mscale) as the CPU kernel rotates with them (`inv_freq` the
        frequencies), or None where it does not (odd dims, over 1024)."""
        if self.dims % 2 or not 0 < self.dims <= 1024:
            return None
        return self.dims, float(self._scale), float(self._mscale)

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        out = cpu_kernels.rope(
            x,
            dims=self.dims,
            inv_freq=self.inv_freq(),
            offset=offset,
            scale=self._scale,
            mscale=self._mscale,
        )
        if out is not None:
            return out
        if self._mscale != 1.0:
            # yarn scales cos and sin, i.e. the rotated vector, by its attention factor.
            x = x * mx.array(self._mscale, dtype=x.dtype)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=False,
            base=self._base,
            scale=self._scale,
            offset=offset,
            freqs=self._freqs,
        )


def default_inv_freq(theta: float, dims: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The inverse frequency of each of the `dims / 2` rotated pairs (unscaled rope)."""
    return _base_inv_freq(theta, dims)


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the first 2 * cos.shape[-1] dims of (B, H, L, D) `x` by per-position angles
    ((L, dims / 2) cosines and sines), in mx.fast.rope's non-traditional pairing (dim i
    with dim i + dims / 2); the rest pass through."""
    half = cos.shape[-1]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if x.shape[-1] > 2 * half:
        parts.append(x[..., 2 * half :])
    return mx.concatenate(parts, axis=-1)


@dataclass(frozen=True)
class Positions:
    """Rotary positions other than the cache's offsets, for multimodal RoPE (Qwen's image
    tokens sit on a grid: runtime/models/qwen3_5_vision.py).

    `shift` moves each row's positions by a constant (an int, or (B,) one per row): the
    text after images sits at offset + shift. `cos` and `sin` ((L, dims / 2)) instead give
    every position of a one-row chunk its own angles."""

    shift: int | mx.array = 0
    cos: mx.array | None = None
    sin: mx.array | None = None

    def apply(self, rope: RoPE, x: mx.array, offset: int | mx.array) -> mx.array:
        if self.cos is None or self.sin is None:
            return rope(x, offset + self.shift)
        return rotate(x, self.cos, self.sin)
