"""Qwen3.5 (dense `qwen3_5`, MoE `qwen3_5_moe`), text only: the Qwen3-Next hybrid
(runtime/models/qwen3_next.py) with separate delta-net projections (in_proj_qkv, _z, _b,
_a) and every layer MoE in the MoE variant (always renormalised top-k).

The multimodal config nests the text model under `text_config`; text-only configs
(`qwen3_5_text`, `qwen3_5_moe_text`) are flat. Checkpoint names come as
``model.language_model.*`` (HF multimodal), ``language_model.model.*`` (mlx-community)
or ``model.*`` (text only); vision weights are skipped here. Rotary: multimodal RoPE
(`mrope_section`) gives every section the same position for text tokens, so it is plain
(partial) RoPE here. A `qwen3_5` or `qwen3_5_moe` config with a vision_config (and a
checkpoint with vision weights) builds qwen3_5_vision.py instead: this text model plus the
vision tower and image positions.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from runtime.models import qwen3_next
from runtime.models.qwen3_next import sanitize_hybrid

log = logging.getLogger(__name__)

_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_VISION_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")
# (checkpoint prefix, parameter prefix), first match wins
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", ""),
)


class ModelArgs(qwen3_next.ModelArgs):
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        """From a multimodal config (its text_config) or a text-only one."""
        model_type = str(config.get("model_type", "qwen3_5"))
        nested = config.get("text_config")
        text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
        # transformers ties (or not) by the top-level config of the model it builds
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        args = cls.parse(
            text,
            model_type=model_type,
            tie_word_embeddings=bool(tie),
            all_sparse=model_type in _MOE_TYPES,
        )
        if model_type in _MOE_TYPES and args.num_experts <= 0:
            raise ValueError(f"{model_type} config has no num_experts")
        return args


def text_weights(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """The language model's weights under text-model names; vision weights dropped."""
    out: dict[str, mx.array] = {}
    skipped = 0
    for name, value in weights.items():
        if name.startswith(_VISION_PREFIXES):
            skipped += 1
            continue
        for prefix, replacement in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
                break
        out[name] = value
    if skipped:
        log.info("qwen3_5: skipping %d vision weights (the vision encoder is not loaded)", skipped)
    return out


class Model(qwen3_next.Model):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return sanitize_hybrid(text_weights(weights), self.args)
