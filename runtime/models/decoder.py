"""The llama-style decoder shared by llama, qwen2 and qwen3.

Those three differ only in defaults and switches (q/k/v bias, per-head q/k norms, head_dim),
so their files hold a ModelArgs with their defaults and reuse this model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import mlx.core as mx
from mlx.nn.layers.base import Module

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
from runtime.models.fused_layer import layer_step
from runtime.models.linear import Embedding
from runtime.models.rope import RoPE, RopeSpec, parse_rope

_T = TypeVar("_T", bound="DecoderArgs")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def decoder_weights(weights: Mapping[str, mx.array], num_layers: int) -> dict[str, mx.array]:
    """The checkpoint tensors that are parameters of a `num_layers` decoder: rotary
    inv_freq buffers dropped, and the layers from `num_layers` on (the multi-token
    prediction layers GLM and DeepSeek checkpoints carry after the decoder)."""
    kept: dict[str, mx.array] = {}
    for name, value in weights.items():
        layer = _LAYER_INDEX.match(name)
        if "rotary_emb.inv_freq" in name or (
            layer is not None and int(layer.group(1)) >= num_layers
        ):
            continue
        kept[name] = value
    return kept


def given_layer_types(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...] | None:
    """The config's own `layer_types`, checked against the layer count; None if absent."""
    given = config.get("layer_types")
    if not given:
        return None
    if len(given) != num_layers:
        raise ValueError(f"layer_types has {len(given)} entries for {num_layers} layers")
    return tuple(str(t) for t in given)


def _layer_types(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    given = given_layer_types(config, num_layers)
    if given is not None:
        return given
    if config.get("use_sliding_window") and config.get("sliding_window"):
        # qwen2/qwen3 convention: layers from max_window_layers on use the window
        first = config_int(config, "max_window_layers", num_layers)
        return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))
    return (FULL_ATTENTION,) * num_layers


@dataclass(frozen=True)
class DecoderShape:
    """What the arguments of every decoder built from LayerStack hold: sizes, norms,
    activation, rope and each layer's kind. Each architecture's arguments extend it."""

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
    rope: RopeSpec
    layer_types: tuple[str, ...]


@dataclass(frozen=True)
class DecoderArgs(DecoderShape):
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
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


class StackArgs(Protocol):
    """What LayerStack reads from an architecture's arguments."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...


class AttentionArgs(StackArgs, Protocol):
    """What make_attention reads from an architecture's arguments."""

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def make_attention(
    args: AttentionArgs,
    rope: RoPE,
    *,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: str | None,
    window: int | None = None,
    scale: float | None = None,
) -> Attention:
    """A layer's attention sized by `args` (q/k norms, if any, with its rms_norm_eps)."""
    return Attention(
        args.hidden_size,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.head_dim,
        rope,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        norm_eps=args.rms_norm_eps,
        scale=scale,
        window=window,
    )


class PreNormBlock(Module):
    """The residual wiring of a llama-style layer: x + attention(norm(x)), then
    h + mlp(norm(h)). Subclasses set `self_attn` and `mlp`, then call `add_norms`."""

    self_attn: Any
    mlp: Any
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def add_norms(self, dims: int, eps: float) -> None:
        self.input_layernorm = RMSNorm(dims, eps)
        self.post_attention_layernorm = RMSNorm(dims, eps)

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        fused = layer_step(self, x, cache)
        if fused is not None:
            return fused
        return self.mlp_half(self.attention_half(x, cache))

    def attention_half(self, x: mx.array, cache: Any) -> mx.array:
        """x + attention(norm(x)): the layer up to its MLP (`LayerStack.stepwise`)."""
        out: mx.array = x + self.self_attn(self.input_layernorm(x), cache)
        return out

    def mlp_half(self, h: mx.array) -> mx.array:
        """h + mlp(norm(h)): the rest of the layer."""
        out: mx.array = h + self.mlp(self.post_attention_layernorm(h))
        return out


class DecoderLayer(PreNormBlock):
    def __init__(self, args: DecoderArgs, rope: RoPE, layer_type: str) -> None:
        super().__init__()
        sliding = layer_type == SLIDING_ATTENTION
        self.self_attn = make_attention(
            args,
            rope,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            qk_norm="rms" if args.qk_norm else None,
            window=args.sliding_window if sliding else None,
        )
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.hidden_act, args.mlp_bias)
        self.add_norms(args.hidden_size, args.rms_norm_eps)


class LayerStack(Module):
    """The `model.` part of a checkpoint: embeddings, `args.num_layers` layers made by
    `make_layer(index)`, final norm. Each layer is called as `layer(h, cache)`."""

    def __init__(self, args: StackArgs, make_layer: Callable[[int], Module]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [make_layer(i) for i in range(args.num_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, tokens: mx.array, caches: Sequence[Any]) -> mx.array:
        h = self.embed_tokens(tokens)
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, cache)
        out: mx.array = self.norm(h)
        return out

    def stepwise(self, tokens: mx.array, caches: Sequence[Any]) -> mx.array:
        """`self(tokens, caches)` for a prompt chunk, computed a piece at a time: half a
        llama-style layer (`PreNormBlock`), or a whole layer of another kind. A piece is
        queued once the one before it is computed (its successor's graph is built in the
        meantime); the last layer only as far as its cache, the rest of it and the final
        norm left to whoever evaluates the result (a prefill reads none of it).

        As one graph, a chunk's layers run ahead of the kernels: MLX's CPU evaluation
        allocates each node's output when it queues the node, up to about a hundred
        kernels (several layers) before the worker computes them. Qwen2.5-Coder-0.5B
        (float32 activations), 2048-token chunks: 330 MB above the weights and caches at
        the peak as one graph, 85 MB a piece at a time, the same keys and values bit for
        bit; the pieces' waits cost 0.5% of the chunk's time."""
        h = self.embed_tokens(tokens)
        queued: list[mx.array] = []

        def queue(arrays: list[mx.array]) -> None:
            nonlocal queued
            mx.eval(queued)  # the piece before: computed, its buffers freed
            mx.async_eval(arrays)
            queued = arrays

        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            halves = type(layer).__call__ is PreNormBlock.__call__
            fused = layer_step(layer, h, cache) if halves else None  # as __call__ does
            halves = halves and fused is None
            if fused is not None:
                h = fused
            else:
                h = layer.attention_half(h, cache) if halves else layer(h, cache)
            queue(list(cache.state) if i == last else [h, *cache.state])
            if halves:
                h = layer.mlp_half(h)
                if i < last:
                    queue([h])
        mx.eval(queued)
        out: mx.array = self.norm(h)
        return out


class DecoderModel(CausalLM):
    def __init__(self, args: DecoderArgs) -> None:
        rope = RoPE(args.rope, args.head_dim)
        super().__init__(
            args, LayerStack(args, lambda i: DecoderLayer(args, rope, args.layer_types[i]))
        )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF checkpoint names -> parameter names (they match; drop what is not a parameter)."""
        return self._drop_tied_head(
            {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        )
