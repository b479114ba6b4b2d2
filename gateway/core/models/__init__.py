"""The served models' lifecycle: the registry (load on demand, keep-alive, eviction),
one loaded model (served), building one (build) and memory accounting (memory)."""

from __future__ import annotations

from gateway.core.models.build import (
    SAMPLING_FIELDS,
    build_served,
    check_draft_tokenizer,
    model_folder,
    sampling_defaults,
    weight_quantization,
)
from gateway.core.models.encoders import build_encoder_served, check_dimensions
from gateway.core.models.memory import (
    cache_budget,
    default_memory_budget,
    parameter_bytes,
    quantized_estimate,
    weight_file_bytes,
)
from gateway.core.models.registry import ModelRegistry
from gateway.core.models.served import ServedModel
from gateway.core.models.slots import Lease
from gateway.core.models.spec import ModelSpec
from gateway.core.models.status import ModelFacts, ModelState, ModelStatus

__all__ = [
    "SAMPLING_FIELDS",
    "Lease",
    "ModelFacts",
    "ModelRegistry",
    "ModelSpec",
    "ModelState",
    "ModelStatus",
    "ServedModel",
    "build_encoder_served",
    "build_served",
    "cache_budget",
    "check_dimensions",
    "check_draft_tokenizer",
    "default_memory_budget",
    "model_folder",
    "parameter_bytes",
    "quantized_estimate",
    "sampling_defaults",
    "weight_file_bytes",
    "weight_quantization",
]
