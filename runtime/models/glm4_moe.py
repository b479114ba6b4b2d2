"""GLM-4.5 / 4.6 / 4.7 (glm4_moe): llama-style layers with partial rotary, optional
per-head q/k norms, q/k/v bias (never on o), the first ``first_k_dense_replace`` layers
dense, the rest sparse MoE with sigmoid grouped routing (``e_score_correction_bias``,
``n_group``/``topk_group``, ``routed_scaling_factor``) plus always-on shared experts.

The checkpoints carry ``num_nextn_predict_layers`` multi-token-prediction layers after
the last decoder layer (``model.layers.<num_hidden_layers>...``), DeepSeek's layout: they
are dropped on load, unless the model drafts with the first one (`keep_mtp`,
`--speculative mtp`: runtime/models/mtp.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from runtime.cache import Cache, KVCache
from runtime.models.base import (
    FULL_ATTENTION,
    MLP,
    CausalLM,
    config_float,
    config_int,
)
from runtime.models.decoder import (
    DecoderShape,
    LayerStack,
    PreNormBlock,
    decoder_weights,
    make_attention,
)
from runtime.models.moe import SIGMOID, Routing, SparseMoE, stack_experts
from runtime.models.mtp import MTPHead, check_mtp_weights, mtp_layers, rename_nextn
from runtime.models.rope import RoPE, parse_rope


def _partial_rotary_factor(config: Mapping[str, Any]) -> float:
    """transformers 5 keeps it in rope_parameters, older configs at the top level."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return config_float(config, "partial_rotary_factor", 0.5)


@dataclass(frozen=True)
class ModelArgs(DecoderShape):
    moe_intermediate_size: int
    rotary_dim: int
    attention_bias: bool
    use_qk_norm: bool
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    routing: Routing
    sliding_window: int | None = None
    mtp_layers: int = 0  # the checkpoint's MTP layers (num_nextn_predict_layers)
    keep_mtp: bool = False  # build and load the first one (runtime/models/mtp.py)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        head_dim = config_int(config, "head_dim", hidden // heads)
        top_k = int(config["num_experts_per_tok"])
        return cls(
            model_type=str(config.get("model_type", "glm4_moe")),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config_int(config, "num_key_value_heads", heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * _partial_rotary_factor(config)),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=config_int(config, "max_position_embeddings", 131072),
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=str(config.get("hidden_act", "silu")),
            attention_bias=bool(config.get("attention_bias", False)),
            use_qk_norm=bool(config.get("use_qk_norm", False)),
            n_routed_experts=int(config.get("n_routed_experts") or config["num_local_experts"]),
            n_shared_experts=config_int(config, "n_shared_experts", 1),
            num_experts_per_tok=top_k,
            first_k_dense_replace=config_int(config, "first_k_dense_replace", 1),
            routing=Routing(
                top_k=top_k,
                scoring=SIGMOID,
                normalize=bool(config.get("norm_topk_prob", True)),
                n_group=config_int(config, "n_group", 1),
                topk_group=config_int(config, "topk_group", 1),
                scaling=config_float(config, "routed_scaling_factor", 1.0),
            ),
            rope=parse_rope(config),
            layer_types=(FULL_ATTENTION,) * layers,
            mtp_layers=mtp_layers(config),
        )


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, rope: RoPE, index: int) -> None:
        super().__init__()
        dims = args.hidden_size
        self.self_attn = make_attention(
            args,
            rope,
            qkv_bias=args.attention_bias,
            o_bias=False,
            qk_norm="rms" if args.use_qk_norm else None,
        )
        self.mlp: MLP | SparseMoE
        if index >= args.first_k_dense_replace:
            self.mlp = SparseMoE(
                dims,
                args.moe_intermediate_size,
                args.n_routed_experts,
                args.routing,
                act=args.hidden_act,
                shared_hidden=args.moe_intermediate_size * args.n_shared_experts,
            )
        else:
            self.mlp = MLP(dims, args.intermediate_size, args.hidden_act)
        self.add_norms(dims, args.rms_norm_eps)


class Model(CausalLM):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        # mx.fast.rope rotates the first rotary_dim features of each head, rest unchanged
        rope = RoPE(args.rope, args.rotary_dim)
        super().__init__(args, LayerStack(args, lambda i: DecoderLayer(args, rope, i)))
        if args.keep_mtp:  # the layer after the decoder's last (sparse, as they are)
            block = DecoderLayer(args, rope, args.num_layers)
            self.mtp = MTPHead(args.hidden_size, args.rms_norm_eps, block, pass_normed=False)

    def mtp_head(self) -> MTPHead | None:
        return self.mtp if self.args.keep_mtp else None

    def mtp_cache(self) -> Cache:
        return KVCache()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop the MTP layers (the first kept with `keep_mtp`), stack per-expert (or
        fused) weights into `switch_mlp`."""
        args = self.args
        named = rename_nextn(weights, args.num_layers, keep=args.keep_mtp)
        if args.keep_mtp:
            check_mtp_weights(named, args.model_type)
        kept = decoder_weights(named, args.num_layers)
        return self._drop_tied_head(stack_experts(kept, args.n_routed_experts))
