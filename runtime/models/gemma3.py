"""Gemma 3 text model (also the text half of a multimodal gemma3 checkpoint).

Differences from llama: embeddings scaled by sqrt(hidden) in the weight dtype, RMSNorm by
(1 + weight), per-head q/k norms, four norms per layer, attention scale
query_pre_attn_scalar**-0.5, gelu (tanh), and interleaved sliding-window layers (local
rope base) with global layers (global rope base, optionally linearly scaled).
Like transformers, attn_logit_softcapping is ignored (a gemma2 setting gemma3 dropped);
final_logit_softcapping is applied. A prefill chunk holding images (gemma3_vision.py) opens
each image's span in the attention mask: its positions see each other both ways.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module

from runtime.cache import Cache, Mask, RaggedCache, window_mask
from runtime.models.base import (
    FULL_ATTENTION,
    MLP,
    SLIDING_ATTENTION,
    Attention,
    CausalLM,
    RMSNorm,
    config_float,
    config_int,
    optional_float,
)
from runtime.models.linear import Embedding
from runtime.models.rope import RoPE, RopeSpec, parse_rope

# [start, end) of each image's positions within a prefill chunk, in order
ImageSpans: TypeAlias = Sequence[tuple[int, int]]

# Prefixes of multimodal checkpoints: the text model's, then the vision parts we drop.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
# transformers' default bases (RopeSpec is frozen, so sharing these is safe)
_GLOBAL_ROPE = RopeSpec(theta=1_000_000.0)
_LOCAL_ROPE = RopeSpec(theta=10_000.0)


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    if isinstance(text, Mapping):
        return text
    return {} if config.get("model_type") == "gemma3" else config


def _layer_types(text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    given = text.get("layer_types")
    if given:
        if len(given) != num_layers:
            raise ValueError(f"layer_types has {len(given)} entries for {num_layers} layers")
        return tuple(str(t) for t in given)
    pattern = config_int(text, "sliding_window_pattern", 6)
    return tuple(
        SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
    )


@dataclass(frozen=True)
class ModelArgs:
    """Defaults are transformers' Gemma3TextConfig defaults: real multimodal configs rely
    on them, listing only what differs."""

    model_type: str = "gemma3_text"
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 262_208
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    hidden_act: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 4096
    layer_types: tuple[str, ...] = ()
    rope_global: RopeSpec = _GLOBAL_ROPE
    rope_local: RopeSpec = _LOCAL_ROPE
    final_logit_softcapping: float | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        """From a gemma3_text config, or a multimodal gemma3 config (its text_config)."""
        text = _text_config(config)
        if text.get("use_bidirectional_attention"):
            raise ValueError(
                "gemma3 with bidirectional attention (embedding models) is unsupported"
            )
        d = cls()
        layers = config_int(text, "num_hidden_layers", d.num_layers)
        tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
        return cls(
            model_type=str(config.get("model_type", d.model_type)),
            hidden_size=config_int(text, "hidden_size", d.hidden_size),
            intermediate_size=config_int(text, "intermediate_size", d.intermediate_size),
            num_layers=layers,
            num_attention_heads=config_int(text, "num_attention_heads", d.num_attention_heads),
            num_key_value_heads=config_int(text, "num_key_value_heads", d.num_key_value_heads),
            head_dim=config_int(text, "head_dim", d.head_dim),
            vocab_size=config_int(text, "vocab_size", d.vocab_size),
            max_position_embeddings=config_int(
                text, "max_position_embeddings", d.max_position_embeddings
            ),
            rms_norm_eps=config_float(text, "rms_norm_eps", d.rms_norm_eps),
            tie_word_embeddings=bool(tie),
            hidden_act=str(text.get("hidden_activation") or text.get("hidden_act") or d.hidden_act),
            attention_bias=bool(text.get("attention_bias", False)),
            query_pre_attn_scalar=config_float(
                text, "query_pre_attn_scalar", d.query_pre_attn_scalar
            ),
            sliding_window=config_int(text, "sliding_window", d.sliding_window),
            layer_types=_layer_types(text, layers),
            rope_global=parse_rope(
                text, layer_type=FULL_ATTENTION, default_theta=d.rope_global.theta
            ),
            # old configs: local layers take rope_local_base_freq and never rope_scaling
            rope_local=parse_rope(
                text,
                layer_type=SLIDING_ATTENTION,
                default_theta=d.rope_local.theta,
                theta_key="rope_local_base_freq",
                apply_old_scaling=False,
            ),
            final_logit_softcapping=optional_float(text, "final_logit_softcapping"),
        )


def open_image_spans(
    base: Mask, length: int, keys: int, spans: ImageSpans, window: int | None
) -> mx.array:
    """`base`, a cache's mask for `length` queries (the last of `keys` positions), with
    each image span of the chunk opened both ways: transformers' mask for token_type_ids,
    OR(causal, same image), AND the sliding window where the layer has one."""
    allowed = base if isinstance(base, mx.array) else window_mask(length, keys, None)
    ids = np.full(keys, -1, dtype=np.int32)
    for n, (start, end) in enumerate(spans):
        ids[keys - length + start : keys - length + end] = n
    key_ids = mx.array(ids)
    query_ids = key_ids[keys - length :, None]
    same = (query_ids == key_ids[None, :]) & (query_ids >= 0)
    if window is not None:
        distance = mx.arange(keys - length, keys)[:, None] - mx.arange(keys)[None, :]
        same = same & (distance < window)
    return allowed | same


class _Attention(Attention):
    """The shared attention, plus the path of a prefill chunk holding image spans."""

    def __call__(
        self, x: mx.array, cache: Cache | RaggedCache, spans: ImageSpans | None = None
    ) -> mx.array:
        if not spans:
            return super().__call__(x, cache)
        assert not isinstance(cache, RaggedCache), "a chunk with images runs alone"
        q, k, v = self.project(x)
        batch, length = q.shape[:2]
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        offset = cache.offset
        q, k = self.rope(q, offset), self.rope(k, offset)
        base = cache.make_mask(length, self.window)
        k, v = cache.update_and_fetch(k, v)
        mask = open_image_spans(base, length, k.shape[2], spans, self.window)
        # not base.attention: its query blocks would hide an image's later keys
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class DecoderLayer(Module):
    def __init__(self, args: ModelArgs, rope: RoPE, layer_type: str) -> None:
        super().__init__()
        sliding = layer_type == SLIDING_ATTENTION
        dims, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = _Attention(
            dims,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm="gemma",
            norm_eps=eps,
            scale=args.query_pre_attn_scalar**-0.5,
            window=args.sliding_window if sliding else None,
        )
        self.mlp = MLP(dims, args.intermediate_size, args.hidden_act)
        self.input_layernorm = RMSNorm(dims, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(dims, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(dims, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(dims, eps, unit_offset=True)

    def __call__(
        self, x: mx.array, cache: Cache | RaggedCache, spans: ImageSpans | None = None
    ) -> mx.array:
        attn = self.self_attn(self.input_layernorm(x), cache, spans)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class TextModel(Module):
    """The `model.` part of the checkpoint."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_scale = args.hidden_size**0.5
        ropes = {
            FULL_ATTENTION: RoPE(args.rope_global, args.head_dim),
            SLIDING_ATTENTION: RoPE(args.rope_local, args.head_dim),
        }
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            DecoderLayer(args, ropes.get(kind, ropes[FULL_ATTENTION]), kind)
            for kind in args.layer_types
        ]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        # transformers rounds the scale to the weight dtype first (bf16: sqrt(3072) -> 55.5)
        return h * mx.array(self.embed_scale, dtype=h.dtype)

    def run(
        self, h: mx.array, caches: Sequence[Cache], spans: ImageSpans | None = None
    ) -> mx.array:
        """The layers and final norm over embeddings `h`; `spans` open images' masks."""
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, cache, spans)
        return self.norm(h)

    def __call__(self, tokens: mx.array, caches: Sequence[Cache]) -> mx.array:
        return self.run(self.embed(tokens), caches)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, TextModel(args))

    def logits(self, hidden: mx.array) -> mx.array:
        out = super().logits(hidden)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            out = mx.tanh(out / cap) * cap
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF names -> parameter names; multimodal checkpoints lose their vision parts."""
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            if "rotary_emb.inv_freq" in name or name.startswith(_VISION_PREFIXES):
                continue
            for prefix, replacement in _TEXT_PREFIXES:
                if name.startswith(prefix):
                    name = replacement + name[len(prefix) :]
                    break
            out[name] = value
        return self._drop_tied_head(out)
