"""The vision tower of Qwen3.5 (transformers' Qwen3_5VisionModel, Qwen3-VL's without its
deepstack mergers): pixels of an image at its own size -> tokens in the text model's width.

- Patches: an image of H x W pixels is (H / P) x (W / P) patches of P x P pixels, laid
  out as the processor lays them out: merge x merge blocks in row-major order, each
  block's patches row-major; every patch repeated over `temporal_patch_size` frames (a
  still image is a clip of identical frames).
- Patch embedding: the Conv3d whose stride is its kernel, as one matmul over the
  flattened patches (weight (out, C * T * P * P), torch's (out, C, T, P, P) flattened).
- Learned position embeddings on a side x side grid, bilinearly interpolated (corners
  aligned) to the image's grid of patches.
- Pre-norm blocks (LayerNorm, biases everywhere): attention over all of one image's
  patches, both ways, with a 2D rotary embedding (the first half of each head's rotated
  pairs turn with the patch's row, the second half with its column); a gelu MLP.
- The merger: each patch LayerNorm-ed, every merge x merge block concatenated into one
  vector, an MLP (exact gelu) to `out_hidden_size`: one token per block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.activations import gelu
from mlx.nn.layers.base import Module
from mlx.nn.layers.normalization import LayerNorm

from runtime.models.base import activation, attention, config_int
from runtime.models.linear import Embedding, Linear
from runtime.models.rope import default_inv_freq, rotate

PATCH_WEIGHT = "patch_embed.proj.weight"
_EPS = 1e-6  # every LayerNorm of the tower
# score elements one attention call may hold: a large image (Qwen3.5 allows 64k patches)
# would otherwise hold patches x patches scores per head where no fused kernel takes the
# head size (72), so its queries go in blocks
_SCORES = 1 << 28
_MIN_BLOCK = 256


def _side(value: Any, default: int, name: str) -> int:
    if value is None:
        return default
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision {name} {value!r}: only equal sides are supported")
        value = value[0]
    return int(value)


@dataclass(frozen=True)
class VisionArgs:
    """transformers' Qwen3_5VisionConfig fields; the defaults are its defaults."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionArgs:
        d = cls()
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
        args = cls(
            depth=config_int(config, "depth", config_int(config, "num_hidden_layers", d.depth)),
            hidden_size=config_int(config, "hidden_size", d.hidden_size),
            intermediate_size=config_int(config, "intermediate_size", d.intermediate_size),
            num_heads=config_int(
                config, "num_heads", config_int(config, "num_attention_heads", d.num_heads)
            ),
            in_channels=config_int(config, "in_channels", d.in_channels),
            patch_size=_side(config.get("patch_size"), d.patch_size, "patch_size"),
            spatial_merge_size=config_int(config, "spatial_merge_size", d.spatial_merge_size),
            temporal_patch_size=_side(
                config.get("temporal_patch_size"), d.temporal_patch_size, "temporal_patch_size"
            ),
            out_hidden_size=config_int(config, "out_hidden_size", d.out_hidden_size),
            num_position_embeddings=config_int(
                config, "num_position_embeddings", d.num_position_embeddings
            ),
            hidden_act=str(config.get("hidden_act") or d.hidden_act),
            rope_theta=float(theta if theta is not None else d.rope_theta),
        )
        if args.hidden_size % args.num_heads or (args.hidden_size // args.num_heads) % 4:
            raise ValueError("vision hidden_size / num_heads must be a multiple of 4")
        side = args.grid_side
        if side * side != args.num_position_embeddings:
            raise ValueError(
                f"vision num_position_embeddings {args.num_position_embeddings} is not a square"
            )
        return args

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return round(self.num_position_embeddings**0.5)

    @property
    def patch_dims(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def patchify(pixels: mx.array, args: VisionArgs) -> mx.array:
    """(N, C, H, W) pixel values -> (N, patches, C * T * P * P), in the processor's order
    (Qwen2VLImageProcessor's pixel_values, one image's rows at a time)."""
    n, channels, height, width = pixels.shape
    p, m, t = args.patch_size, args.spatial_merge_size, args.temporal_patch_size
    if channels != args.in_channels or height % (p * m) or width % (p * m):
        raise ValueError(
            f"pixel values of shape {(channels, height, width)}: the vision tower takes "
            f"{args.in_channels} channels, sides multiples of {p * m}"
        )
    rows, cols = height // p, width // p
    x = pixels.reshape(n, channels, rows // m, m, p, cols // m, m, p)
    x = x.transpose(0, 2, 5, 3, 6, 1, 4, 7)  # blocks, patch in block, channel, pixel
    x = mx.broadcast_to(x[:, :, :, :, :, :, None], (*x.shape[:6], t, p, p))
    return x.reshape(n, rows * cols, args.patch_dims)


@lru_cache(maxsize=64)
def _grid_tables(
    rows: int, cols: int, merge: int, side: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """For each patch in block order: its (row, col), and the four table entries and
    weights that interpolate the side x side position grid at it (transformers'
    bilinear, corners aligned, in float32)."""
    r = np.arange(rows).reshape(rows // merge, 1, merge, 1)
    c = np.arange(cols).reshape(1, cols // merge, 1, merge)
    shape = (rows // merge, cols // merge, merge, merge)
    row = np.broadcast_to(r, shape).reshape(-1)
    col = np.broadcast_to(c, shape).reshape(-1)

    def axis(index: np.ndarray[Any, Any], size: int) -> tuple[Any, Any]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        raw = floor.astype(np.int64)[:, None] + np.arange(2)
        distance = np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32))
        return np.clip(raw, 0, side - 1), np.clip(1 - distance, 0, None).astype(np.float32)

    h_taps, h_weights = axis(row, rows)
    w_taps, w_weights = axis(col, cols)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return np.stack([row, col]), indices.astype(np.int32), weights


class PatchEmbed(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.proj = Linear(args.patch_dims, args.hidden_size)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches.astype(self.proj.weight.dtype))


class VisionAttention(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.num_heads, args.head_dim
        self.qkv = Linear(args.hidden_size, 3 * args.hidden_size)
        self.proj = Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        batch, length, _ = x.shape
        qkv = self.qkv(x).reshape(batch, length, 3, self.n_heads, self.head_dim)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        # transformers rotates in float32
        q = rotate(q.astype(mx.float32), cos, sin).astype(v.dtype)
        k = rotate(k.astype(mx.float32), cos, sin).astype(v.dtype)
        scale = self.head_dim**-0.5
        block = max(_MIN_BLOCK, _SCORES // (batch * self.n_heads * length))
        outs = [
            attention(q[:, :, s : s + block], k, v, scale=scale, mask=None)
            for s in range(0, length, block)
        ]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class VisionMLP(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = Linear(args.hidden_size, args.intermediate_size)
        self.linear_fc2 = Linear(args.intermediate_size, args.hidden_size)
        self._act = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self._act(self.linear_fc1(x)))


class VisionBlock(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = LayerNorm(args.hidden_size, eps=_EPS)
        self.norm2 = LayerNorm(args.hidden_size, eps=_EPS)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        h = x + self.attn(self.norm1(x), cos, sin)
        return h + self.mlp(self.norm2(h))


class PatchMerger(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        merged = args.hidden_size * args.spatial_merge_size**2
        self.norm = LayerNorm(args.hidden_size, eps=_EPS)
        self.linear_fc1 = Linear(merged, merged)
        self.linear_fc2 = Linear(merged, args.out_hidden_size)
        self._merged = merged

    def __call__(self, x: mx.array) -> mx.array:
        n = x.shape[0]
        h = self.norm(x).reshape(n, -1, self._merged)  # a block's patches are consecutive
        return self.linear_fc2(gelu(self.linear_fc1(h)))


class VisionTower(Module):
    """The `visual.` part of a checkpoint (transformers' Qwen3_5VisionModel)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)
        half = args.head_dim // 2
        self._inv_freq = default_inv_freq(args.rope_theta, half).astype(np.float32)

    def hidden_states(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        """(N, rows * cols, C * T * P * P) patches of N images of `grid` (rows, cols)
        patches -> (N, rows * cols, hidden), the last block's output."""
        a = self.args
        rows, cols = grid
        merge = a.spatial_merge_size
        if rows % merge or cols % merge or patches.shape[1] != rows * cols:
            raise ValueError(f"{patches.shape[1]} patches for a {rows} x {cols} grid")
        where, indices, weights = _grid_tables(rows, cols, merge, a.grid_side)
        x = self.patch_embed(patches)
        # (patches, 4, hidden); through the module, which also reads a quantized table
        # (MLX converters that quantize the tower quantize its embedding too)
        table: mx.array = self.pos_embed(mx.array(indices))
        # weighted in float32, as transformers does
        positions = (table.astype(mx.float32) * mx.array(weights)[:, :, None]).sum(axis=1)
        x = x + positions.astype(x.dtype)
        turns = where.astype(np.float32)[:, :, None] * self._inv_freq  # (2, patches, hd/4)
        angles = mx.array(np.concatenate([turns[0], turns[1]], axis=-1))  # rows, then cols
        cos, sin = mx.cos(angles), mx.sin(angles)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def __call__(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        """-> (N, rows * cols / merge^2, out_hidden): one token per merge x merge block."""
        out: mx.array = self.merger(self.hidden_states(patches, grid))
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Tower-relative checkpoint names -> parameter names: the patch convolution's
        weight flattened (torch's (out, C, T, P, P), or MLX converters' (out, T, P, P, C))."""
        out = dict(weights)
        weight = out.get(PATCH_WEIGHT)
        if weight is not None and weight.ndim == 5:
            channels = self.args.in_channels
            if weight.shape[1] != channels and weight.shape[-1] == channels:
                weight = weight.transpose(0, 4, 1, 2, 3)
            out[PATCH_WEIGHT] = weight.reshape(weight.shape[0], -1)
        return out
