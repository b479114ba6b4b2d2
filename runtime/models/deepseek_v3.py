"""DeepSeek V3 (and the models published under its model_type: Kimi K2, Moonlight).

Multi-head latent attention (runtime/models/mla.py) over a cache of latents
(runtime/cache/latent.py); MLPs are dense for the first `first_k_dense_replace` layers
(and off the `moe_layer_freq` rhythm), elsewhere sparse MoE with DeepSeek's router:
sigmoid scores, `e_score_correction_bias` for the choice, group-limited top k
(`n_group`, `topk_group`), `norm_topk_prob`, `routed_scaling_factor`, plus
`n_shared_experts` always-on experts (runtime/models/moe.py).

Checkpoints may carry multi-token-prediction layers after the last decoder layer
(index >= num_hidden_layers): `sanitize` drops them, unless the model was built to draft
with the first one (`keep_mtp`, `--speculative mtp`: runtime/models/mtp.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import mlx.core as mx

from runtime.cache import Cache, LatentCache
from runtime.models.base import MLP, CausalLM, config_float, config_int
from runtime.models.decoder import LayerStack, PreNormBlock, decoder_weights
from runtime.models.mla import MLAConfig, MultiLatentAttention, fuse_absorbed_weights, make_rope
from runtime.models.moe import SIGMOID, Routing, SparseMoE, stack_experts
from runtime.models.mtp import MTPHead, check_mtp_weights, mtp_layers, rename_nextn
from runtime.models.rope import RoPE


@dataclass(frozen=True)
class ModelArgs:
    """Defaults are DeepseekV3Config's, which real configs may rely on."""

    mla: MLAConfig
    model_type: str = "deepseek_v3"
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_layers: int = 61
    vocab_size: int = 129280
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    mtp_layers: int = 0  # the checkpoint's MTP layers (num_nextn_predict_layers)
    keep_mtp: bool = False  # build and load the first one (runtime/models/mtp.py)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        d = cls(mla=MLAConfig.from_config(config))
        # transformers 5 may write num_local_experts (its attribute map); null: dense
        keys = [k for k in ("n_routed_experts", "num_local_experts") if k in config]
        experts = (config[keys[0]] or 0) if keys else None
        return cls(
            mla=d.mla,
            model_type=str(config.get("model_type", d.model_type)),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=config_int(config, "intermediate_size", d.intermediate_size),
            moe_intermediate_size=config_int(
                config, "moe_intermediate_size", d.moe_intermediate_size
            ),
            num_layers=int(config["num_hidden_layers"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=config_int(
                config, "max_position_embeddings", d.max_position_embeddings
            ),
            rms_norm_eps=config_float(config, "rms_norm_eps", d.rms_norm_eps),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=str(config.get("hidden_act", d.hidden_act)),
            n_routed_experts=d.n_routed_experts if experts is None else int(experts),
            num_experts_per_tok=config_int(config, "num_experts_per_tok", d.num_experts_per_tok),
            n_shared_experts=config_int(config, "n_shared_experts", d.n_shared_experts),
            n_group=config_int(config, "n_group", d.n_group),
            topk_group=config_int(config, "topk_group", d.topk_group),
            norm_topk_prob=bool(config.get("norm_topk_prob", d.norm_topk_prob)),
            routed_scaling_factor=config_float(
                config, "routed_scaling_factor", d.routed_scaling_factor
            ),
            first_k_dense_replace=config_int(
                config, "first_k_dense_replace", d.first_k_dense_replace
            ),
            moe_layer_freq=config_int(config, "moe_layer_freq", d.moe_layer_freq),
            mtp_layers=mtp_layers(config),
        )

    def is_sparse(self, index: int) -> bool:
        """DeepSeek's rule: MoE from layer `first_k_dense_replace` on, every
        `moe_layer_freq`-th layer (transformers omits the rhythm; every release has 1)."""
        return (
            self.n_routed_experts > 0
            and index >= self.first_k_dense_replace
            and index % self.moe_layer_freq == 0
        )

    @property
    def routing(self) -> Routing:
        return Routing(
            top_k=self.num_experts_per_tok,
            scoring=SIGMOID,
            normalize=self.norm_topk_prob,
            n_group=self.n_group,
            topk_group=self.topk_group,
            scaling=self.routed_scaling_factor,
        )


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, rope: RoPE, index: int) -> None:
        super().__init__()
        dims = args.hidden_size
        self.self_attn = MultiLatentAttention(args.mla, rope)
        self.mlp: MLP | SparseMoE
        if args.is_sparse(index):
            shared = args.moe_intermediate_size * args.n_shared_experts
            self.mlp = SparseMoE(
                dims,
                args.moe_intermediate_size,
                args.n_routed_experts,
                args.routing,
                act=args.hidden_act,
                shared_hidden=shared or None,
            )
        else:
            self.mlp = MLP(dims, args.intermediate_size, args.hidden_act)
        self.add_norms(dims, args.rms_norm_eps)


class Model(CausalLM):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        rope = make_rope(args.mla)
        super().__init__(args, LayerStack(args, lambda i: DecoderLayer(args, rope, i)))
        if args.keep_mtp:  # the layer after the decoder's last, MoE as they are
            block = DecoderLayer(args, rope, args.num_layers)
            self.mtp = MTPHead(args.hidden_size, args.rms_norm_eps, block, pass_normed=False)

    def make_caches(self) -> list[Cache]:
        """One latent cache per layer: every layer is MLA over the whole context."""
        return [LatentCache() for _ in range(self.args.num_layers)]

    def mtp_head(self) -> MTPHead | None:
        return self.mtp if self.args.keep_mtp else None

    def mtp_cache(self) -> Cache:
        return LatentCache()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF names -> parameter names: MTP layers dropped (the first kept with
        `keep_mtp`), experts stacked (per-expert, fused or already stacked layouts all
        load), mlx-lm's split kv_b_proj re-fused."""
        args = self.args
        named = rename_nextn(weights, args.num_layers, keep=args.keep_mtp)
        if args.keep_mtp:
            check_mtp_weights(named, args.model_type)
        kept = fuse_absorbed_weights(decoder_weights(named, args.num_layers), args.mla)
        return self._drop_tied_head(stack_experts(kept, args.n_routed_experts))
