"""Qwen3-MoE: qwen3 attention (per-head q/k RMSNorm, head_dim from config) with sparse MoE
MLPs (softmax top-k routing, optional renormalisation; no shared expert).

A layer is sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``
rhythm (layer i is sparse when (i + 1) % step == 0); other layers use a dense MLP of
``intermediate_size``. With ``use_sliding_window`` every layer attends within the window,
as transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from runtime.models.base import (
    FULL_ATTENTION,
    MLP,
    SLIDING_ATTENTION,
    CausalLM,
    config_float,
    config_int,
)
from runtime.models.decoder import (
    DecoderShape,
    LayerStack,
    PreNormBlock,
    given_layer_types,
    make_attention,
)
from runtime.models.moe import Routing, SparseMoE, stack_experts
from runtime.models.rope import RoPE, parse_rope


def _num_experts(config: Mapping[str, Any]) -> int:
    # transformers 5 writes num_local_experts (its attribute map), older configs num_experts
    value = config.get("num_experts", config.get("num_local_experts"))
    if value is None:
        raise ValueError("qwen3_moe config names neither num_experts nor num_local_experts")
    return int(value)


def _layer_types(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    given = given_layer_types(config, num_layers)
    if given is not None:
        return given
    sliding = config.get("use_sliding_window") and config.get("sliding_window")
    return (SLIDING_ATTENTION if sliding else FULL_ATTENTION,) * num_layers


@dataclass(frozen=True)
class ModelArgs(DecoderShape):
    moe_intermediate_size: int
    attention_bias: bool
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        experts = _num_experts(config)
        step = config_int(config, "decoder_sparse_step", 1)
        dense_only = {int(i) for i in config.get("mlp_only_layers") or ()}
        sparse = tuple(
            i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
        layer_types = _layer_types(config, layers)
        window = config.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
        return cls(
            model_type=str(config.get("model_type", "qwen3_moe")),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config_int(config, "num_key_value_heads", heads),
            head_dim=config_int(config, "head_dim", hidden // heads),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=config_int(config, "max_position_embeddings", 32768),
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=str(config.get("hidden_act", "silu")),
            attention_bias=bool(config.get("attention_bias", False)),
            num_experts=experts,
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            sparse_layers=sparse,
            rope=parse_rope(config),
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
        )


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, rope: RoPE, index: int) -> None:
        super().__init__()
        dims = args.hidden_size
        sliding = args.layer_types[index] == SLIDING_ATTENTION
        self.self_attn = make_attention(
            args,
            rope,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm="rms",
            window=args.sliding_window if sliding else None,
        )
        self.mlp: MLP | SparseMoE
        if args.sparse_layers[index]:
            routing = Routing(top_k=args.num_experts_per_tok, normalize=args.norm_topk_prob)
            self.mlp = SparseMoE(
                dims, args.moe_intermediate_size, args.num_experts, routing, act=args.hidden_act
            )
        else:
            self.mlp = MLP(dims, args.intermediate_size, args.hidden_act)
        self.add_norms(dims, args.rms_norm_eps)


class Model(CausalLM):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        rope = RoPE(args.rope, args.head_dim)
        super().__init__(args, LayerStack(args, lambda i: DecoderLayer(args, rope, i)))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF per-expert or fused expert weights -> stacked `switch_mlp` (mlx-community
        folders are stacked already)."""
        kept = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        return self._drop_tied_head(stack_experts(kept, self.args.num_experts))
