"""Loading a model for serving: a HF-style folder, an MLX-quantized or FP8 folder, or a
GGUF file (runtime.load.gguf), into a runtime.models architecture with its tokenizer."""

from __future__ import annotations

from runtime.load.decoder_encoder import MODEL_TASKS
from runtime.load.encoder import (
    EncoderTask,
    LoadedEncoder,
    ScoreActivation,
    encoder_task,
    is_encoder,
    load_encoder,
)
from runtime.load.gguf import GGUFFile, hf_config, tokenizer_from_gguf
from runtime.load.loaded import LoadedModel, ShardHook, context_length
from runtime.load.loader import check_quantize, load, load_tokenizer
from runtime.load.precision import (
    DEFAULT_QUANTIZE_GROUP,
    QUANTIZE_GROUPS,
    QuantizeSpec,
)

__all__ = [
    "DEFAULT_QUANTIZE_GROUP",
    "MODEL_TASKS",
    "QUANTIZE_GROUPS",
    "EncoderTask",
    "GGUFFile",
    "LoadedEncoder",
    "LoadedModel",
    "QuantizeSpec",
    "ScoreActivation",
    "ShardHook",
    "check_quantize",
    "context_length",
    "encoder_task",
    "hf_config",
    "is_encoder",
    "load",
    "load_encoder",
    "load_tokenizer",
    "tokenizer_from_gguf",
]
