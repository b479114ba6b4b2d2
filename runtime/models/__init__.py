"""Model architectures: one module per HF `model_type`, built from a config.json dict."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from runtime.models.base import ArgsLike, LanguageModel
from runtime.models.encoder import EncoderArgs, EncoderModel
from runtime.models.linear import choose_small_gemm
from runtime.models.pooling import Pooling, PoolingMode, normalized, pool

# model_type -> module under runtime.models (several types may share one module)
_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {
        "llama": "llama",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "gemma3_text": "gemma3",
        "gemma3": "gemma3",
        "qwen3_moe": "qwen3_moe",
        "glm4_moe": "glm4_moe",
        "glm4_moe_lite": "glm4_moe_lite",
        "qwen3_next": "qwen3_next",
        "qwen3_5": "qwen3_5",
        "qwen3_5_text": "qwen3_5",
        "qwen3_5_moe": "qwen3_5",
        "qwen3_5_moe_text": "qwen3_5",
        "deepseek_v3": "deepseek_v3",
        "deepseek_v2": "deepseek_v2",
    }
)
# model_type -> module, for configs with a vision_config (the text model plus its vision
# tower: runtime.vision.spans.VisionModel); Qwen3.5's MoE shares the dense one's tower and
# positions, only its text model differs (qwen3_5.py reads which from the model type)
_VISION_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {"gemma3": "gemma3_vision", "qwen3_5": "qwen3_5_vision", "qwen3_5_moe": "qwen3_5_vision"}
)


# model_type -> module, for bidirectional encoders (embedding models, cross-encoders):
# runtime.models.encoder.EncoderModel, built by build_encoder
_ENCODER_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "camembert": "bert"}
)


def is_encoder_config(config: Mapping[str, Any]) -> bool:
    """Whether config.json describes an encoder (served for embeddings or scores)."""
    return str(config.get("model_type")) in _ENCODER_ARCHITECTURES


def build_encoder(config: Mapping[str, Any]) -> EncoderModel:
    """An encoder with uninitialised weights for a HF config dict (see build_model)."""
    model_type = str(config.get("model_type"))
    module_name = _ENCODER_ARCHITECTURES.get(model_type)
    if module_name is None:
        known = ", ".join(sorted(_ENCODER_ARCHITECTURES))
        raise ValueError(f"unsupported encoder model_type {model_type!r}; supported: {known}")
    module = importlib.import_module(f"runtime.models.{module_name}")
    model: EncoderModel = module.Model(module.ModelArgs.from_config(config))
    return model


def supported_model_types() -> list[str]:
    return sorted(_ARCHITECTURES)


def build_model(config: Mapping[str, Any]) -> LanguageModel:
    """A model with uninitialised (random) weights for a HF config dict.

    Load weights with ``model.load_weights(list(model.sanitize(weights).items()))``.
    """
    model_type = config.get("model_type")
    module_name = _ARCHITECTURES.get(str(model_type))
    if module_name is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    if isinstance(config.get("vision_config"), Mapping):
        module_name = _VISION_ARCHITECTURES.get(str(model_type), module_name)
    module = importlib.import_module(f"runtime.models.{module_name}")
    args = module.ModelArgs.from_config(config)
    model: LanguageModel = module.Model(args)
    choose_small_gemm(model)  # by the shapes; the loader chooses again once sharded
    return model


__all__ = [
    "ArgsLike",
    "EncoderArgs",
    "EncoderModel",
    "LanguageModel",
    "Pooling",
    "PoolingMode",
    "build_encoder",
    "build_model",
    "is_encoder_config",
    "normalized",
    "pool",
    "supported_model_types",
]
