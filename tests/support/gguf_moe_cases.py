"""The tiny mixture-of-experts models the GGUF loader tests convert (one per shape of file
llama.cpp writes for qwen3moe, glm4moe and deepseek2), saved as checkpoints, their weights
optionally rounded through a GGUF quant type so that a quantized file holds them exactly;
`llama_cpp_routing`, transformers' DeepSeek-V2 routers as llama.cpp's graph computes them.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import QuantError
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from tests.support.tiny_deepseek import (
    _YARN,
    DEEPSEEK_PLAIN,
    _deepseek,
    _deepseek_v2,
    add_mtp_layer,
)
from tests.support.tiny_models import Variant, randomize, save_tiny
from tests.support.tiny_moe import VARIANTS as MOE_VARIANTS
from tests.support.tiny_moe import _glm4_moe, _qwen3_moe

# DeepSeek's own YaRN shape, scaled down; mscale == mscale_all_dim, the only case a
# deepseek2 GGUF can state (llama.cpp keeps the rotation's magnitude at 1)
YARN = {
    **_YARN,
    "mscale": 0.8,
    "mscale_all_dim": 0.8,
}


@dataclass(frozen=True)
class MoeCase:
    """A tiny transformers model and how llama.cpp would convert it."""

    arch: str  # GGUF general.architecture
    variant: Variant
    mtp: bool = False  # the checkpoint carries a multi-token-prediction layer
    # deepseek2's kv_b_proj: "split" (llama.cpp's MLA layout, attn_k_b / attn_v_b),
    # "whole" (attn_kv_b, files before it) or "both" (files from the transition)
    kv_b: str = "split"
    # routed experts' gate and up fused in one ffn_gate_up_exps (newer conversions)
    gate_up: bool = False


CASES: Mapping[str, MoeCase] = {
    # all layers sparse (llama.cpp's qwen3moe has no dense ones), renormalised top-2
    "qwen3moe": MoeCase("qwen3moe", (lambda: _qwen3_moe(norm_topk_prob=True), None)),
    "qwen3moe_tied_bias": MoeCase(
        "qwen3moe",
        (
            lambda: _qwen3_moe(
                norm_topk_prob=True,
                num_experts_per_tok=3,
                tie_word_embeddings=True,
                attention_bias=True,
            ),
            None,
        ),
    ),
    # grouped routing, scaled weights, 2 shared experts, q/k norms and bias, an MTP layer
    "glm4moe": MoeCase("glm4moe", MOE_VARIANTS["glm4_moe"], mtp=True),
    # one group, weights not renormalised, a quarter of each head rotated, tied head
    "glm4moe_plain": MoeCase(
        "glm4moe",
        (
            lambda: _glm4_moe(
                norm_topk_prob=False,
                tie_word_embeddings=True,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 5e4,
                    "partial_rotary_factor": 0.25,
                },
            ),
            None,
        ),
    ),
    # query LoRA, YaRN, grouped routing; llama.cpp's current MLA layout
    "deepseek2": MoeCase("deepseek2", (lambda: _deepseek(rope_parameters=dict(YARN)), None)),
    # V2-Lite's shape: queries projected directly, kv_b_proj whole (files before
    # llama.cpp's MLA), plain rope, biases, no groups, no renormalising, MoE from layer 0
    "deepseek2_lite_old": MoeCase(
        "deepseek2",
        (
            lambda: _deepseek(**DEEPSEEK_PLAIN),
            None,
        ),
        mtp=True,
        kv_b="whole",
    ),
    # plain rope, kv_b_proj both whole and split
    "deepseek2_kv_b_both": MoeCase(
        "deepseek2",
        (lambda: _deepseek(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), None),
        kv_b="both",
    ),
    # experts' gate and up fused (ffn_gate_up_exps), as newer llama.cpp conversions write;
    # kv_b_proj both ways, so that a Q8_0 file holds all of it exactly (k_b's 16-wide
    # rows are no whole Q8_0 block: the converter's F16 fallback would round them again)
    "deepseek2_gate_up": MoeCase(
        "deepseek2",
        (lambda: _deepseek(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), None),
        kv_b="both",
        gate_up=True,
    ),
    "glm4moe_gate_up": MoeCase("glm4moe", MOE_VARIANTS["glm4_moe"], gate_up=True),
    # DeepSeek-V2 (softmax gating): query LoRA, YaRN, groups, renormalised and scaled
    "deepseek2_v2": MoeCase(
        "deepseek2",
        (
            lambda: _deepseek_v2(
                topk_method="group_limited_greedy",
                num_experts_per_tok=3,
                scoring_func="softmax",
                norm_topk_prob=True,
                routed_scaling_factor=4.0,
            ),
            None,
        ),
    ),
    # V2-Lite's shape in a file from before llama.cpp wrote the gating (absent: softmax)
    # or its MLA layout: greedy, whole kv_b_proj, plain rope, biases
    "deepseek2_v2_lite_old": MoeCase(
        "deepseek2",
        (lambda: _deepseek_v2(**DEEPSEEK_PLAIN, topk_method="greedy"), None),
        kv_b="whole",
    ),
}


def build(case: MoeCase, directory: Path, seed: int = 0, quant: QT | None = None) -> Any:
    """The transformers model of `case`, randomized, its weights rounded through `quant`
    (so that the GGUF holds them exactly), saved as a checkpoint into `directory`."""
    spread = partial(randomize, bias_scale=0.1)
    if quant is not None:
        spread = partial(_spread_rounded, quant=quant)
    model = save_tiny(case.variant, directory, seed, spread)
    if case.mtp:
        add_mtp_layer(directory, model.config.num_hidden_layers)
    return model


def _spread_rounded(model: Any, seed: int, quant: QT) -> None:
    randomize(model, seed, bias_scale=0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                values = param.detach().float().numpy()
                param.copy_(torch.from_numpy(round_trip(values, quant)))


def round_trip(values: np.ndarray, quant: QT) -> np.ndarray:
    """`values` as the GGUF will hold them: quantized row-wise (or F16 where rows are not
    whole blocks, the converter's fallback) and back."""
    data, qtype = quantize(values, quant)
    return np.asarray(reference_dequantize(data, qtype), dtype=np.float32).reshape(values.shape)


def quantize(values: np.ndarray, quant: QT) -> tuple[np.ndarray, QT]:
    """What the converter writes for a 2-D+ weight of a `quant` file."""
    if quant == QT.F32:
        return np.ascontiguousarray(values, dtype=np.float32), QT.F32
    try:
        return reference_quantize(np.ascontiguousarray(values, dtype=np.float32), quant), quant
    except QuantError:
        return reference_quantize(np.ascontiguousarray(values, dtype=np.float32), QT.F16), QT.F16


@contextmanager
def llama_cpp_routing(model: Any) -> Iterator[None]:
    """Within, `model`'s DeepSeek-V2 routers (if any) compute what llama.cpp's deepseek2
    graph does for a softmax file: a group scores the sum of its two best probabilities
    (V2's own code: its best one), and the chosen weights are renormalised when
    norm_topk_prob (which V2's code ignores), then scaled."""
    routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV2TopkRouter"]
    for router in routers:
        router.forward = partial(_llama_cpp_route, router, model.config)
    try:
        yield
    finally:
        for router in routers:
            del router.forward


def _llama_cpp_route(router: Any, cfg: Any, hidden: torch.Tensor) -> Any:
    x = hidden.reshape(-1, router.hidden_dim).float()
    logits = torch.nn.functional.linear(x, router.weight.float())
    probs = logits.softmax(dim=-1)
    choice = probs
    groups = cfg.n_group or 1
    if groups > 1:
        grouped = probs.view(x.shape[0], groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(probs)
    indices = choice.topk(router.top_k, dim=-1).indices
    weights = probs.gather(-1, indices)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights * cfg.routed_scaling_factor, indices
