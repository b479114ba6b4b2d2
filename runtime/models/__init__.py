"""Model architectures: one module per HF `model_type`, built from a config.json dict."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from runtime.models.base import ArgsLike, LanguageModel
from runtime.models.encoder import EncoderArgs, EncoderModel
from runtime.models.linear import choose_small_gemm
from runtime.models.mtp import keeping_mtp, mtp_layers
from runtime.models.pooling import Pooling, PoolingMode, normalized, pool
from runtime.models.qwen3_embed import Head as DecoderHead
from runtime.models.qwen3_embed import build as build_decoder_encoder

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
    {
        "bert": "bert",
        "roberta": "bert",
        "xlm-roberta": "bert",
        "camembert": "bert",
        "modernbert": "modernbert",
    }
)
# encoders whose modeling code lives in the checkpoint's own repository (trust_remote_code
# in transformers): recognised, so that loading one says so by name
_REMOTE_CODE_ENCODERS: Mapping[str, str] = MappingProxyType({"nomic_bert": "nomic-bert"})


def is_encoder_config(config: Mapping[str, Any]) -> bool:
    """Whether config.json describes an encoder (served for embeddings or scores)."""
    model_type = str(config.get("model_type"))
    return model_type in _ENCODER_ARCHITECTURES or model_type in _REMOTE_CODE_ENCODERS


def build_encoder(config: Mapping[str, Any]) -> EncoderModel:
    """An encoder with uninitialised weights for a HF config dict (see build_model)."""
    model_type = str(config.get("model_type"))
    module_name = _ENCODER_ARCHITECTURES.get(model_type)
    if model_type in _REMOTE_CODE_ENCODERS:
        raise ValueError(
            f"the {_REMOTE_CODE_ENCODERS[model_type]} architecture (model_type {model_type!r}) "
            "is not supported: its modeling code ships with the checkpoint (remote code), "
            "not with transformers"
        )
    if module_name is None:
        known = ", ".join(sorted(_ENCODER_ARCHITECTURES))
        raise ValueError(f"unsupported encoder model_type {model_type!r}; supported: {known}")
    module = importlib.import_module(f"runtime.models.{module_name}")
    model: EncoderModel = module.Model(module.ModelArgs.from_config(config))
    return model


def supported_model_types() -> list[str]:
    return sorted(_ARCHITECTURES)


def build_model(config: Mapping[str, Any], *, mtp: bool = False) -> LanguageModel:
    """A model with uninitialised (random) weights for a HF config dict; `mtp`: with its
    multi-token-prediction layer (runtime/models/mtp.py; a ValueError where it has none).

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
    if mtp:
        args = keeping_mtp(args)
    model: LanguageModel = module.Model(args)
    choose_small_gemm(model)  # by the shapes; the loader chooses again once sharded
    return model


__all__ = [
    "ArgsLike",
    "DecoderHead",
    "EncoderArgs",
    "EncoderModel",
    "LanguageModel",
    "Pooling",
    "PoolingMode",
    "build_decoder_encoder",
    "build_encoder",
    "build_model",
    "is_encoder_config",
    "mtp_layers",
    "normalized",
    "pool",
    "supported_model_types",
]
