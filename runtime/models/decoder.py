"""The llama-style decoder shared by llama, qwen2 and qwen3.

Those three differ only in defaults and switches (q/k/v bias, per-head q/k norms, head_dim),
so their files hold a ModelArgs with their defaults and reuse this model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding

from runtime.cache import Cache
from runtime.models.base import (
    FULL_ATTENTION,
    MLP,
    SLIDING_ATTENTION,
    Attention,
    CausalLM,
    RMSNorm,
    config_float,
    config_int,
)
from runtime.models.rope import RoPE, RopeSpec, parse_rope

_T = TypeVar("_T", bound="DecoderArgs")


def _layer_types(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    given = config.get("layer_types")
    if given:
        if len(given) != num_layers:
            raise ValueError(f"layer_types has {len(given)} entries for {num_layers} layers")
        return tuple(str(t) for t in given)
    if config.get("use_sliding_window") and config.get("sliding_window"):
        # qwen2/qwen3 convention: layers from max_window_layers on use the window
        first = config_int(config, "max_window_layers", num_layers)
        return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))
    return (FULL_ATTENTION,) * num_layers


@dataclass(frozen=True)
class DecoderArgs:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeSpec
    layer_types: tuple[str, ...]
    sliding_window: int | None

    @classmethod
    def parse(
        cls: type[_T],
        config: Mapping[str, Any],
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
        default_head_dim: int | None = None,
        default_max_positions: int = 2048,
    ) -> _T:
        """Read a HF config dict; the keyword arguments are the architecture's fixed choices."""
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        layer_types = _layer_types(config, layers)
        window = config.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
        return cls(
            model_type=str(config.get("model_type", "")),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config_int(config, "num_key_value_heads", heads),
            head_dim=config_int(config, "head_dim", default_head_dim or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=config_int(
                config, "max_position_embeddings", default_max_positions
            ),
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=str(config.get("hidden_act", "silu")),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=qk_norm,
            rope=parse_rope(config),
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
        )


class DecoderLayer(Module):
    def __init__(self, args: DecoderArgs, rope: RoPE, layer_type: str) -> None:
        super().__init__()
        sliding = layer_type == SLIDING_ATTENTION
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            qk_norm="rms" if args.qk_norm else None,
            norm_eps=args.rms_norm_eps,
            window=args.sliding_window if sliding else None,
        )
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.hidden_act, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Cache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBody(Module):
    """The `model.` part of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        rope = RoPE(args.rope, args.head_dim)
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, rope, kind) for kind in args.layer_types]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, tokens: mx.array, caches: Sequence[Cache]) -> mx.array:
        h = self.embed_tokens(tokens)
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, cache)
        return self.norm(h)


class DecoderModel(CausalLM):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__(args, DecoderBody(args))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF checkpoint names -> parameter names (they match; drop what is not a parameter)."""
        return self._drop_tied_head({k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k})
