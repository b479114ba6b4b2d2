"""The SigLIP vision tower (Gemma 3's image encoder): pixels -> one hidden state per patch.

Patches are embedded by a stride = kernel convolution, done here as one matmul over the
flattened patches (the weight kept as (out, channels * patch * patch), torch's
(out, C, kh, kw) flattened in that order). Learned absolute position embeddings, one per
patch (images always come at the trained size, so no interpolation); pre-norm encoder
layers with bidirectional multi-head attention and a gelu MLP, biases everywhere; a final
LayerNorm. SigLIP's attention-pooling head is not part of it: Gemma 3 reads the patches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.normalization import LayerNorm

from runtime.models.base import activation, attention, config_float, config_int
from runtime.models.linear import Embedding, Linear

PATCH_WEIGHT = "embeddings.patch_embedding.weight"


def _square(value: Any, default: int, name: str) -> int:
    """An image or patch size: an int, or [height, width] with both equal."""
    if value is None:
        return default
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"vision {name} {value!r}: only square sizes are supported")
        value = value[0]
    return int(value)


@dataclass(frozen=True)
class VisionArgs:
    """transformers' SiglipVisionConfig fields; the defaults are its defaults."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionArgs:
        d = cls()
        args = cls(
            hidden_size=config_int(config, "hidden_size", d.hidden_size),
            intermediate_size=config_int(config, "intermediate_size", d.intermediate_size),
            num_layers=config_int(config, "num_hidden_layers", d.num_layers),
            num_attention_heads=config_int(config, "num_attention_heads", d.num_attention_heads),
            num_channels=config_int(config, "num_channels", d.num_channels),
            image_size=_square(config.get("image_size"), d.image_size, "image_size"),
            patch_size=_square(config.get("patch_size"), d.patch_size, "patch_size"),
            layer_norm_eps=config_float(config, "layer_norm_eps", d.layer_norm_eps),
            hidden_act=str(config.get("hidden_act") or d.hidden_act),
        )
        if args.image_size % args.patch_size:
            raise ValueError(
                f"vision image_size {args.image_size} is not a multiple of patch_size "
                f"{args.patch_size}"
            )
        if args.hidden_size % args.num_attention_heads:
            raise ValueError("vision hidden_size must be a multiple of num_attention_heads")
        return args

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2


class Embeddings(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        patch = args.num_channels * args.patch_size**2
        self.patch_embedding = Linear(patch, args.hidden_size)
        self.position_embedding = Embedding(args.num_patches, args.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        """(N, C, H, W) pixel values -> (N, patches, hidden), patches in row-major order."""
        a = self.args
        n, channels, height, width = pixels.shape
        if (channels, height, width) != (a.num_channels, a.image_size, a.image_size):
            raise ValueError(
                f"pixel values of shape {(channels, height, width)}; the vision tower takes "
                f"{(a.num_channels, a.image_size, a.image_size)}"
            )
        p, side = a.patch_size, a.patches_per_side
        patches = pixels.reshape(n, channels, side, p, side, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(n, side * side, channels * p * p)
        x = self.patch_embedding(patches.astype(self.patch_embedding.weight.dtype))
        positions: mx.array = self.position_embedding(mx.arange(a.num_patches))
        return x + positions


class VisionAttention(Module):
    """Bidirectional multi-head attention over the patches."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dims = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = dims // self.n_heads
        self.q_proj = Linear(dims, dims)
        self.k_proj = Linear(dims, dims)
        self.v_proj = Linear(dims, dims)
        self.out_proj = Linear(dims, dims)

    def __call__(self, x: mx.array) -> mx.array:
        batch, length, _ = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(batch, length, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = attention(q, k, v, scale=self.head_dim**-0.5, mask=None)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class VisionMLP(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.fc1 = Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = Linear(args.intermediate_size, args.hidden_size)
        self._act = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self._act(self.fc1(x)))


class EncoderLayer(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = VisionAttention(args)
        self.layer_norm2 = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = VisionMLP(args)

    def __call__(self, x: mx.array) -> mx.array:
        h = x + self.self_attn(self.layer_norm1(x))
        return h + self.mlp(self.layer_norm2(h))


class Encoder(Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = [EncoderLayer(args) for _ in range(args.num_layers)]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return x


class VisionTower(Module):
    """The `vision_tower.` part of a checkpoint (transformers' SiglipVisionModel)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        """(N, C, H, W) pixel values -> (N, patches, hidden) last hidden states."""
        out: mx.array = self.post_layernorm(self.encoder(self.embeddings(pixels)))
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Tower-relative checkpoint names -> parameter names: the pooling head dropped,
        the patch convolution's weight flattened (torch's (out, C, kh, kw), or MLX
        converters' (out, kh, kw, C))."""
        out = {k: v for k, v in weights.items() if not k.startswith("head.")}
        weight = out.get(PATCH_WEIGHT)
        if weight is not None and weight.ndim == 4:
            channels = self.args.num_channels
            if weight.shape[1] != channels and weight.shape[3] == channels:
                weight = weight.transpose(0, 3, 1, 2)
            out[PATCH_WEIGHT] = weight.reshape(weight.shape[0], -1)
        return out
