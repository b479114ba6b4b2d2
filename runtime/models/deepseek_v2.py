"""DeepSeek-V2 (V2, V2-Lite, V2.5, Coder-V2), as transformers' deepseek_v2 defines it.

The network is DeepSeek-V3's (runtime/models/deepseek_v3.py: multi-head latent attention
over a latent cache, dense MLPs for the first `first_k_dense_replace` layers, then MoE
with `n_shared_experts` always-on experts); the router differs. V2 scores experts with a
softmax, has no score-correction bias, and multiplies the chosen weights by
`routed_scaling_factor`. `topk_method` picks the experts:

- "greedy": the k best.
- "group_limited_greedy": the experts form `n_group` equal groups, a group scores its
  best expert's probability, and the k best come from the `topk_group` best groups.
- "noaux_tc": V3's rules over the softmax scores: a group scores its two best experts'
  sum, and the weights are renormalised when `norm_topk_prob`, then scaled. No V2
  release says it; it is what llama.cpp computes for a softmax deepseek2 GGUF, whose
  config runtime/load/gguf/moe.py writes with it.

Under the two V2 methods `norm_topk_prob` is ignored, as transformers and mlx-lm do
(DeepSeek's own V2 code would renormalise instead of scaling; every V2 release sets it
false). `moe_layer_freq` is read as for V3 (transformers' V2 omits it; every release has
1). transformers' V2 has no `rope_interleave` switch: the rotary dims always pair up
interleaved (its complex form), so they do here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Self

from runtime.models import deepseek_v3
from runtime.models.moe import GROUP_MAX, GROUP_TOP2, SOFTMAX, Routing

log = logging.getLogger(__name__)

GREEDY = "greedy"
GROUP_LIMITED_GREEDY = "group_limited_greedy"
NOAUX_TC = "noaux_tc"
_TOPK_METHODS = (GREEDY, GROUP_LIMITED_GREEDY, NOAUX_TC)


@dataclass(frozen=True)
class ModelArgs(deepseek_v3.ModelArgs):
    """Defaults are DeepseekV2Config's, which real configs may rely on."""

    model_type: str = "deepseek_v2"
    hidden_size: int = 4096
    intermediate_size: int = 11008
    moe_intermediate_size: int = 1407
    num_layers: int = 32
    vocab_size: int = 102400
    max_position_embeddings: int = 2048
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    topk_method: str = GREEDY

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        _check_supported(config)
        args = super().from_config(config)
        method = str(config.get("topk_method") or GREEDY)
        if method != GREEDY and args.n_routed_experts > 0:
            _check_groups(config, args.n_routed_experts, method)
        if args.norm_topk_prob and method != NOAUX_TC:
            log.warning(
                "deepseek_v2: norm_topk_prob is true, but under topk_method %r the routed "
                "weights are scaled, not renormalised (as transformers' DeepSeek-V2 does)",
                method,
            )
        return replace(args, topk_method=method, mla=replace(args.mla, rope_interleave=True))

    @property
    def routing(self) -> Routing:
        grouped = self.topk_method != GREEDY
        v3_rules = self.topk_method == NOAUX_TC
        return Routing(
            top_k=self.num_experts_per_tok,
            scoring=SOFTMAX,
            normalize=v3_rules and self.norm_topk_prob,
            n_group=self.n_group if grouped else 1,
            topk_group=self.topk_group if grouped else 1,
            scaling=self.routed_scaling_factor,
            group_score=GROUP_TOP2 if v3_rules else GROUP_MAX,
        )


def _check_supported(config: Mapping[str, Any]) -> None:
    """What transformers' deepseek_v2 has no way to compute, or computes otherwise than
    the checkpoint means, is refused rather than served as a different model."""
    method = config.get("topk_method") or GREEDY
    if method not in _TOPK_METHODS:
        raise ValueError(
            f"deepseek_v2: unsupported topk_method {method!r} (supported: "
            f"{', '.join(_TOPK_METHODS)})"
        )
    scoring = config.get("scoring_func") or SOFTMAX
    if scoring != SOFTMAX:
        raise ValueError(
            f"deepseek_v2: scoring_func {scoring!r} is not supported (only softmax; "
            "sigmoid-routed DeepSeek models are deepseek_v3)"
        )
    if config.get("mlp_bias"):
        raise ValueError("deepseek_v2: mlp_bias is not supported")


def _check_groups(config: Mapping[str, Any], experts: int, method: str) -> None:
    groups, used = config.get("n_group"), config.get("topk_group")
    if groups is None or used is None:
        raise ValueError(f"deepseek_v2: topk_method {method!r} needs n_group and topk_group")
    if int(groups) < 1 or experts % int(groups) or not 1 <= int(used) <= int(groups):
        raise ValueError(
            f"deepseek_v2: n_group {groups} and topk_group {used} do not split "
            f"{experts} experts into equal groups of which some are kept"
        )


class Model(deepseek_v3.Model):
    """DeepSeek-V3's model with V2's arguments (the router follows `ModelArgs.routing`)."""

    args: ModelArgs
