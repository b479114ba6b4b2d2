"""What loading a model produces (`LoadedModel`), and the steps every source kind shares:
the dtype policy's names, swapping in quantized modules, the strict weight load, and the
facts read from a config (context length, end-of-turn ids)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.quantized import quantize

from runtime import backend
from runtime.models.base import LanguageModel
from runtime.models.linear import choose_small_gemm, drop_symmetric_biases, use_lanes
from runtime.text import Tokenizer
from runtime.vision import VisionSpec

log = logging.getLogger(__name__)

DTYPES: Mapping[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}
# Called on the model once its weights are loaded, before they are evaluated: a
# distributed rank keeps its part there, so it never reads the rest
# (runtime/distributed/load.py).
ShardHook = Callable[[LanguageModel], None]
_DEFAULT_CONTEXT = 4096
# End-of-turn markers of chat vocabularies; a GGUF names only one eos id, but chat
# models end their turns with these.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
)


@dataclass(frozen=True)
class LoadedModel:
    model: LanguageModel
    tokenizer: Tokenizer
    config: dict[str, Any]
    chat_template: str | None
    eos_token_ids: frozenset[int]
    name: str
    source: Path
    context_length: int
    quantized: bool
    dtype: str
    # how the weights are held, for what must not cross a change of it (the prefix
    # cache's disk tier): the float dtype, "q4g64" (--quantize), "gguf-native",
    # "mlx-native", "fp8-q8g64"
    weight_format: str
    load_seconds: float = 0.0
    # generation_config.json as the model's authors wrote it (a GGUF's general.sampling.*
    # metadata under the same names): their recommended sampling, among other things
    generation_config: Mapping[str, Any] = field(default_factory=dict)
    # for a vision model: its image placeholder and preprocessing; None for text models
    vision: VisionSpec | None = None


def resolve_dtype(dtype: str | None, default: str | None = None) -> tuple[str, mx.Dtype]:
    """A dtype name and its MLX dtype; None means ``default``, else the backend's."""
    name = dtype or default or backend.default_dtype_name()
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}")
    return name, DTYPES[name]


def end_of_turn_ids(tokenizer: Tokenizer) -> list[int]:
    ids = (tokenizer.token_to_id(tok) for tok in END_OF_TURN_TOKENS)
    return [i for i in ids if i is not None]


def context_length(config: Mapping[str, Any]) -> int:
    text = config.get("text_config")
    for cfg in (config, text if isinstance(text, Mapping) else {}):
        value = cfg.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return _DEFAULT_CONTEXT


def finish_model(
    model: LanguageModel, weights: dict[str, mx.array], shard: ShardHook | None = None
) -> None:
    """Strict load (a missing or extra tensor is an error), then materialize. The
    checkpoint's dict lets go of its tensors first: only what the model (or its shard)
    keeps is ever read."""
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    weights.clear()
    if shard is not None:
        shard(model)
    mx.eval(model.parameters())
    freed = drop_symmetric_biases(model)
    if freed:
        log.info("symmetric groups kept without biases: %.1f MB less", freed / 1e6)
    moved = use_lanes(model)
    if moved:
        mx.eval(model.parameters())
        log.info("%d linear layers' weights in 16-feature lanes (the CPU decode layout)", moved)
    choose_small_gemm(model)


def quantize_modules(model: LanguageModel, params: Mapping[str, Mapping[str, Any]]) -> None:
    """Swap the listed modules for their quantized versions (with their own bits)."""

    def predicate(path: str, module: Module) -> bool | dict[str, Any]:
        spec = params.get(path)
        if spec is None or not hasattr(module, "to_quantized"):
            return False
        return dict(spec)

    quantize(model, class_predicate=predicate)  # type: ignore[arg-type]
