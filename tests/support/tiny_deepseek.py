"""Tiny random transformers DeepSeek-V3, DeepSeek-V2 and GLM-4.7-Flash models (the oracles
for runtime/models/deepseek_v3.py, deepseek_v2.py and glm4_moe_lite.py).

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``: this module
imports both at the top.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import Variant, randomize, save_tiny

VOCAB = 1024
HEADS = 4
KV_LORA_RANK = 32
QK_NOPE, QK_ROPE, V_HEAD = 16, 8, 16
LAYERS = 3

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "kv_lora_rank": KV_LORA_RANK,
    "q_lora_rank": 32,
    "qk_nope_head_dim": QK_NOPE,
    "qk_rope_head_dim": QK_ROPE,
    "v_head_dim": V_HEAD,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
}

# DeepSeek's own shape of YaRN, scaled down: mscale != mscale_all_dim so that both the
# rotary attention factor and the softmax-scale correction differ from 1
_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "rope_theta": 10_000.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}

# DeepSeek-V2's own YaRN, scaled down: mscale == mscale_all_dim (the rotation keeps its
# magnitude, the softmax scale still grows)
V2_YARN = {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}


def _deepseek(**extra: Any) -> Any:
    config = copy.deepcopy({**_BASE, **extra})  # transformers may rewrite nested dicts
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))


def _deepseek_v2(**extra: Any) -> Any:
    """A V2 on V3's tiny shape: softmax routing, V2's YaRN unless `extra` says otherwise."""
    config = copy.deepcopy({**_BASE, "rope_parameters": dict(V2_YARN), **extra})
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**config))


def _glm4_moe_lite(**extra: Any) -> Any:
    """GLM-4.7-Flash on V3's tiny shape (its per-layer `mlp_layer_types` for V3's
    `first_k_dense_replace`, which Glm4MoeLiteConfig does not read)."""
    base = {k: v for k, v in _BASE.items() if k != "first_k_dense_replace"}
    config = copy.deepcopy({**base, **extra})
    return transformers.Glm4MoeLiteForCausalLM(transformers.Glm4MoeLiteConfig(**config))


def _old_rope_keys(config: dict[str, Any]) -> dict[str, Any]:
    """transformers-5 `rope_parameters` rewritten as DeepSeek's released config.json has
    them: top-level rope_theta and rope_scaling with "type"."""
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    return config


# name -> (builder, config.json rewrite or None)
# queries projected directly, biases, ungrouped routing, no renormalising, two shared
# experts, MoE from layer 0, plain rope (V2-Lite's shape)
DEEPSEEK_PLAIN: dict[str, Any] = {
    "q_lora_rank": None,
    "attention_bias": True,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.5,
    "n_shared_experts": 2,
    "first_k_dense_replace": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5_000.0},
}

VARIANTS: Mapping[str, Variant] = {
    # q through the low-rank pair, interleaved YaRN rope, grouped routing
    "deepseek_v3": (lambda: _deepseek(rope_parameters=dict(_YARN)), None),
    # q_proj directly, plain rope in halves, biases, ungrouped routing, no renormalising,
    # two shared experts, MoE from layer 0
    "deepseek_v3_plain": (lambda: _deepseek(**DEEPSEEK_PLAIN, rope_interleave=False), None),
    "deepseek_v3_old_rope_keys": (lambda: _deepseek(rope_parameters=dict(_YARN)), _old_rope_keys),
}

# V2: DeepSeek-V2's shape (query LoRA, group-limited routing, scaled weights, YaRN) with
# its config.json's key spellings; V2-Lite's (queries projected directly, greedy
# routing, biases, two shared experts, MoE from layer 0, plain rope), norm_topk_prob on
V2_VARIANTS: Mapping[str, Variant] = {
    "deepseek_v2": (
        lambda: _deepseek_v2(
            topk_method="group_limited_greedy",
            num_experts_per_tok=3,  # more than the groups kept, as V2's 6 of 3 groups
            scoring_func="softmax",
            norm_topk_prob=False,
            routed_scaling_factor=4.0,
        ),
        _old_rope_keys,
    ),
    "deepseek_v2_lite": (
        lambda: _deepseek_v2(**{**DEEPSEEK_PLAIN, "norm_topk_prob": True}, topk_method="greedy"),
        None,
    ),
}


def _hub_config(config: dict[str, Any]) -> dict[str, Any]:
    """A transformers-written GLM-4.7-Flash config.json as zai-org ships it: no
    mlp_layer_types (first_k_dense_replace instead), top-level rope_theta and
    partial_rotary_factor, the noaux_tc method named."""
    types = config.pop("mlp_layer_types")
    dense = types.index("sparse")
    assert types == ["dense"] * dense + ["sparse"] * (len(types) - dense)
    params = dict(config.pop("rope_parameters"))
    config.update(
        first_k_dense_replace=dense,
        moe_layer_freq=1,
        rope_theta=params.pop("rope_theta"),
        rope_scaling=None,
        partial_rotary_factor=1.0,
        topk_method="noaux_tc",
    )
    return config


_LITE_PLAIN = {k: v for k, v in DEEPSEEK_PLAIN.items() if k != "first_k_dense_replace"}


def _lite() -> Any:
    return _glm4_moe_lite(
        mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )


# GLM-4.7-Flash: query LoRA, interleaved rope at its base, grouped routing, norm_topk_prob,
# MoE after one dense layer (also with the config as zai-org writes it); and queries
# projected directly, rope in halves with YaRN, biases, ungrouped routing without
# renormalising, two shared experts, a dense layer between sparse ones (which no
# first_k_dense_replace can say)
LITE_VARIANTS: Mapping[str, Variant] = {
    "glm4_moe_lite": (_lite, None),
    "glm4_moe_lite_plain": (
        lambda: _glm4_moe_lite(
            **{**_LITE_PLAIN, "rope_parameters": dict(_YARN)},
            rope_interleave=False,
            mlp_layer_types=["sparse", "dense", "sparse"],
        ),
        None,
    ),
    "glm4_moe_lite_hub": (_lite, _hub_config),
}


def add_mtp_layer(directory: Path, num_layers: int = LAYERS) -> list[str]:
    """Append a multi-token-prediction layer (index `num_layers`) to a saved checkpoint,
    shaped as DeepSeek ships it; return its tensor names."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    extra = {mtp + k[len(last) :]: v.clone() for k, v in tensors.items() if k.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    extra[mtp + "eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    extra[mtp + "enorm.weight"] = torch.ones(hidden)
    extra[mtp + "hnorm.weight"] = torch.ones(hidden)
    extra[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **extra}, str(path), metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return sorted(extra)


def make_tiny(name: str, directory: Path, seed: int = 0) -> Any:
    """Build the `name` variant (V3's, V2's or GLM-4.7-Flash's), save it into `directory`;
    return the torch model (eval)."""
    variant = {**VARIANTS, **V2_VARIANTS, **LITE_VARIANTS}[name]
    return save_tiny(variant, directory, seed, partial(randomize, bias_scale=0.05))


def torch_state(model: Any) -> dict[str, mx.array]:
    """transformers' in-memory tensors (fused experts) as MLX arrays, buffers included."""
    state = model.state_dict()
    return {k: mx.array(v.detach().float().numpy()) for k, v in state.items()}
