"""GLM-4.7-Flash (glm4_moe_lite), as transformers' glm4_moe_lite defines it.

The network is DeepSeek-V3's (runtime/models/deepseek_v3.py): multi-head latent attention
over a latent cache (queries through `q_a_proj`/`q_b_proj` or, with `q_lora_rank` null,
`q_proj`; interleaved rotary unless `rope_interleave` is false; YaRN's mscale in the
softmax scale), and GLM-4.5's MoE, which is V3's router (sigmoid scores,
`e_score_correction_bias` for the choice only, groups scored by their two best experts,
`norm_topk_prob`, `routed_scaling_factor`) plus `n_shared_experts` always-on experts.

What differs from V3:

- Which layers are MoE comes from `mlp_layer_types` ("dense" / "sparse" per layer), as
  transformers writes it. A config without it (zai-org's, which carries
  `first_k_dense_replace` instead) takes DeepSeek's rule, as every other runtime does;
  transformers' own default, the first layer dense, is that rule with its default of 1.
- The defaults (GLM-4.7-Flash's shape: 20 heads, ranks 768/512, head dims 192+64/256,
  64 experts of which 4, no groups, scaling 1.8).
- `head_dim` is another name for `qk_rope_head_dim` (transformers' attribute map), and
  the rotary embedding reads `partial_rotary_factor`; transformers' attention only runs
  with the factor 1, so another factor, or a `head_dim` that disagrees, is refused.

transformers drops the multi-token-prediction layer (`model.layers.47`) on load; so does
`sanitize`, for any layer index from `num_hidden_layers` on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Self

from runtime.models import deepseek_v3

DENSE = "dense"
SPARSE = "sparse"

# Glm4MoeLiteConfig's defaults for what MLAConfig and V3's from_config read as required
_REQUIRED_DEFAULTS: Mapping[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "vocab_size": 154880,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
}


@dataclass(frozen=True)
class ModelArgs(deepseek_v3.ModelArgs):
    """Defaults are Glm4MoeLiteConfig's, which real configs may rely on."""

    model_type: str = "glm4_moe_lite"
    hidden_size: int = 2048
    intermediate_size: int = 10240
    moe_intermediate_size: int = 1536
    num_layers: int = 47
    vocab_size: int = 154880
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    n_routed_experts: int = 64
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.8
    first_k_dense_replace: int = 1
    # None: DeepSeek's rule (first_k_dense_replace, moe_layer_freq) decides
    mlp_layer_types: tuple[str, ...] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        _check_supported(config)
        args = super().from_config({**_REQUIRED_DEFAULTS, **config})
        layer_types = _mlp_layer_types(config, args.num_layers)
        args = replace(args, mlp_layer_types=layer_types)
        sparse = [i for i in range(args.num_layers) if args.is_sparse(i)]
        if sparse and args.n_routed_experts <= 0:
            raise ValueError(
                f"glm4_moe_lite: layers {sparse} are sparse but n_routed_experts is "
                f"{args.n_routed_experts}"
            )
        if sparse:
            _check_groups(args)
        return args

    def is_sparse(self, index: int) -> bool:
        if self.mlp_layer_types is None:
            return super().is_sparse(index)
        return self.mlp_layer_types[index] == SPARSE


def _mlp_layer_types(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...] | None:
    given = config.get("mlp_layer_types")
    if given is None:
        return None
    types = tuple(str(t) for t in given)
    if len(types) != num_layers or not set(types) <= {DENSE, SPARSE}:
        raise ValueError(
            f"glm4_moe_lite: mlp_layer_types must name {num_layers} layers (num_hidden_layers), "
            f"each {DENSE!r} or {SPARSE!r}; got {list(given)!r}"
        )
    return types


def _partial_rotary_factor(config: Mapping[str, Any]) -> Any:
    """transformers 5 keeps it in rope_parameters, older configs at the top level."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("partial_rotary_factor") is not None:
        return params["partial_rotary_factor"]
    return config.get("partial_rotary_factor")


def _check_supported(config: Mapping[str, Any]) -> None:
    """What transformers' glm4_moe_lite cannot compute, or would read otherwise than the
    checkpoint means, is refused rather than served as a different model."""
    factor = _partial_rotary_factor(config)
    if factor is not None and float(factor) != 1.0:
        raise ValueError(
            f"glm4_moe_lite: partial_rotary_factor {factor} is not supported (only 1.0: "
            "every qk_rope_head_dim dim rotates)"
        )
    head_dim, rope_dim = config.get("head_dim"), config.get("qk_rope_head_dim")
    if head_dim is not None and rope_dim is not None and int(head_dim) != int(rope_dim):
        raise ValueError(
            f"glm4_moe_lite: head_dim {head_dim} differs from qk_rope_head_dim {rope_dim} "
            "(transformers reads head_dim as qk_rope_head_dim)"
        )
    method = config.get("topk_method")
    if method is not None and method != "noaux_tc":
        raise ValueError(f"glm4_moe_lite: topk_method {method!r} is not supported (noaux_tc)")
    scoring = config.get("scoring_func")
    if scoring is not None and scoring != "sigmoid":
        raise ValueError(f"glm4_moe_lite: scoring_func {scoring!r} is not supported (sigmoid)")
    if config.get("mlp_bias"):
        raise ValueError("glm4_moe_lite: mlp_bias is not supported")


def _check_groups(args: ModelArgs) -> None:
    """transformers views the experts as `n_group` equal groups and scores each by its two
    best; anything else fails there, so it is refused here."""
    groups, used, experts = args.n_group, args.topk_group, args.n_routed_experts
    if groups < 1 or experts % groups or experts // groups < 2 or not 1 <= used <= groups:
        raise ValueError(
            f"glm4_moe_lite: n_group {groups} and topk_group {used} do not split "
            f"{experts} experts into equal groups of two or more of which some are kept"
        )


class Model(deepseek_v3.Model):
    """DeepSeek-V3's model with GLM-4.7-Flash's arguments (the MLP of each layer follows
    `ModelArgs.is_sparse`)."""

    args: ModelArgs
