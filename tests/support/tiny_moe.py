"""Tiny random transformers MoE models (qwen3_moe, glm4_moe) saved as HF folders.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``: this module
imports both at the top.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import torch
import transformers

from tests.support import tiny_models
from tests.support.tiny_models import Variant, randomize, save_tiny

HIDDEN = 64
VOCAB = 1024
MOE_HIDDEN = 32  # a multiple of 32, so that the experts quantize with group size 32

_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "moe_intermediate_size": MOE_HIDDEN,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
}


def _qwen3_moe(**extra: Any) -> Any:
    config = {
        **_COMMON,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6,
        **extra,
    }
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))


def _glm4_moe(**extra: Any) -> Any:
    config = {
        **_COMMON,
        "num_hidden_layers": 3,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-5,
        **extra,
    }
    return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**config))


def _old_glm_keys(config: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's own config.json spelling: rope_theta and partial_rotary_factor on top."""
    params = config.pop("rope_parameters")
    config["rope_theta"] = params["rope_theta"]
    config["partial_rotary_factor"] = params["partial_rotary_factor"]
    return config


# name -> (builder, config.json rewrite or None)
VARIANTS: Mapping[str, Variant] = {
    # layer 1 dense (mlp_only_layers), plain top-k weights
    "qwen3_moe": (lambda: _qwen3_moe(mlp_only_layers=[1]), None),
    # every second layer sparse, renormalised top-3, tied embeddings, attention bias
    "qwen3_moe_norm": (
        lambda: _qwen3_moe(
            decoder_sparse_step=2,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            attention_bias=True,
        ),
        None,
    ),
    # grouped routing (4 groups, 2 kept), scaled weights, q/k norms, q/k/v bias
    "glm4_moe": (
        lambda: _glm4_moe(
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            n_shared_experts=2,
            use_qk_norm=True,
            attention_bias=True,
        ),
        None,
    ),
    # one group, unnormalised weights, old config keys, MTP weights in the checkpoint
    "glm4_moe_plain": (
        lambda: _glm4_moe(
            norm_topk_prob=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e4,
                "partial_rotary_factor": 0.25,
            },
        ),
        _old_glm_keys,
    ),
}


def _add_mtp_layer(directory: Path, num_layers: int) -> None:
    """What GLM checkpoints carry after the decoder: a multi-token-prediction layer."""
    path = directory / "model.safetensors"
    weights = mx.load(str(path))
    assert isinstance(weights, dict)
    prefix = f"model.layers.{num_layers}"
    weights[f"{prefix}.eh_proj.weight"] = mx.zeros((HIDDEN, 2 * HIDDEN))
    weights[f"{prefix}.enorm.weight"] = mx.ones((HIDDEN,))
    weights[f"{prefix}.mlp.experts.0.gate_proj.weight"] = mx.zeros((MOE_HIDDEN, HIDDEN))
    mx.save_safetensors(str(path), weights, metadata={"format": "pt"})


def write_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer: "w<i>" is token i; w2 ends a generation."""
    config = {"eos_token": "w2", "bos_token": "w1", "chat_template": "{{ x }}"}
    tiny_models.write_tokenizer(folder, vocab, config)


def make_tiny(name: str, directory: Path, seed: int = 0) -> Any:
    """Build the `name` variant, save it (and a tokenizer) into `directory`; return the
    torch model (eval, eager attention)."""
    model = save_tiny(VARIANTS[name], directory, seed, partial(randomize, bias_scale=0.1))
    if name.startswith("glm4_moe"):
        _add_mtp_layer(directory, model.config.num_hidden_layers)
    write_tokenizer(directory)
    return model


def torch_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (no EOS stop)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in np.asarray(out[0, len(prompt) :])]
