"""Tiny random hybrid models (qwen3_next, qwen3_5 dense and MoE) from transformers, saved as
HF folders, as the oracle for runtime/models/qwen3_next.py and qwen3_5.py.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.support import tiny_models
from tests.support.tiny_models import Variant, save_tiny

HIDDEN = 64
VOCAB = 1024

# value heads share key heads (4 over 2) and key/value head sizes differ, so a mix-up of
# heads or of the fused layouts shows
_TEXT: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
    },
}
_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": HIDDEN,
}


def _qwen3_next(**extra: Any) -> Any:
    config = transformers.Qwen3NextConfig(**{**_TEXT, **_MOE, **extra})
    return transformers.Qwen3NextForCausalLM(config)


def _qwen3_5(**top: Any) -> Any:
    config = transformers.Qwen3_5Config(text_config=_TEXT, vision_config=_VISION, **top)
    return transformers.Qwen3_5ForConditionalGeneration(config)


def _qwen3_5_moe() -> Any:
    text = {**_TEXT, **_MOE}
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=_VISION)
    return transformers.Qwen3_5MoeForConditionalGeneration(config)


def _qwen3_5_text(**extra: Any) -> Any:
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**_TEXT, **extra}))


def _old_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The spelling of the published Qwen3-Next config: top-level rope_theta and
    partial_rotary_factor, full_attention_interval instead of layer_types."""
    params = config.pop("rope_parameters")
    config["rope_theta"] = params["rope_theta"]
    config["partial_rotary_factor"] = params["partial_rotary_factor"]
    types = config.pop("layer_types")
    config["full_attention_interval"] = types.index("full_attention") + 1
    return config


VARIANTS: Mapping[str, Variant] = {
    # a dense layer among the MoE ones (mlp_only_layers), attention mid-stack
    "qwen3_next": (lambda: _qwen3_next(mlp_only_layers=[1], full_attention_interval=2), None),
    "qwen3_next_old_keys": (lambda: _qwen3_next(full_attention_interval=2), _old_keys),
    "qwen3_5": (_qwen3_5, None),
    # transformers ties by the top-level config of a multimodal model
    "qwen3_5_tied": (lambda: _qwen3_5(tie_word_embeddings=True), None),
    "qwen3_5_moe": (_qwen3_5_moe, None),
    "qwen3_5_text": (lambda: _qwen3_5_text(num_hidden_layers=3, full_attention_interval=3), None),
}


def _randomize(model: Any, seed: int) -> None:
    """Spread the weights so that a wrong formula shows: norms away from their init,
    decays from nearly none to fast (some state survives many chunks), a real conv."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(shape: torch.Size, low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen) * (high - low) + low

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(uniform(param.shape, math.log(0.02), math.log(2.0)))
            elif name.endswith("dt_bias"):
                param.copy_(uniform(param.shape, -4.0, 1.0))
            elif "conv1d" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.4)
            elif "norm" in name:
                param.copy_(uniform(param.shape, -0.4, 0.6))
            elif name.endswith("mlp.gate.weight"):  # routers: no near ties between experts
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.08)


def make_tiny(name: str, directory: Path, seed: int = 0) -> Any:
    """Build the `name` variant, save it into `directory`; return the torch model (eval)."""
    return save_tiny(VARIANTS[name], directory, seed, _randomize)


def write_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer ("w0".."w<vocab-1>"), so runtime.load.loader can load the folder."""
    tiny_models.write_tokenizer(folder, vocab)
