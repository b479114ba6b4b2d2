"""Load a GGUF file: config, weights (any quant type), tokenizer and chat template all
from the one file (the dtype policy: runtime/load/loader.py's docstring)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gguf.constants import GGMLQuantizationType as QT

from runtime.load.gguf.config import hf_config
from runtime.load.gguf.decode import Plan
from runtime.load.gguf.names import convert_weights
from runtime.load.gguf.quants import is_float
from runtime.load.gguf.reader import GGUFFile
from runtime.load.gguf.tokenizer import tokenizer_from_gguf
from runtime.load.loaded import (
    LoadedModel,
    ShardHook,
    context_length,
    end_of_turn_ids,
    finish_model,
    quantize_modules,
    resolve_dtype,
)
from runtime.load.precision import (
    Precision,
    QuantizeSpec,
    log_dequantized_experts,
    quantize_targets,
)
from runtime.models import build_model
from runtime.text import token_ids

log = logging.getLogger(__name__)

# gguf-py's Keys.General.SAMPLING_* (written by convert_hf_to_gguf.py from
# generation_config.json) -> generation_config.json's own names
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def load_gguf(
    path: Path, dtype: str | None, precision: Precision, shard: ShardHook | None = None
) -> LoadedModel:
    """A GGUF file as a LoadedModel (``load``'s arguments: runtime/load/loader.py)."""
    gf = GGUFFile(path)
    config = hf_config(gf)
    default = None
    if precision.keep_quantized and not precision.cpu:
        default = "float32" if gf.architecture.startswith("gemma") else "float16"
    dtype_name, mx_dtype = resolve_dtype(dtype, default)
    model = build_model(config)  # parameters stay lazy: only their names and shapes
    targets: dict[str, int] = {}
    if precision.quantize is not None:
        check_float_gguf(gf, precision.quantize)
        targets = quantize_targets(model, precision.quantize, precision)
    plan = Plan(mx_dtype, precision, targets)
    # The tokenizer build is mostly Python (GIL-bound) and the weight conversion mostly
    # numpy (GIL-free): overlapping them hides most of the tokenizer's time.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(tokenizer_from_gguf, gf)
        converted = convert_weights(gf, config, plan)
        tokenizer = pending.result()
    log_dequantized_experts(converted.dequantized_experts)
    if converted.quantization:
        quantize_modules(model, converted.quantization)
    finish_model(model, converted.weights, shard)
    template = gf.get("tokenizer.chat_template")
    generation = gguf_generation_config(gf.metadata)
    # A GGUF names one eos id; chat turns end with the vocabulary's end-of-turn token
    # (a base model without a template may still be prompted in its chat format).
    eos = set(tokenizer.eos_token_ids) | set(token_ids(config.get("eos_token_id")))
    eos.update(end_of_turn_ids(tokenizer))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        chat_template=str(template) if template else None,
        eos_token_ids=frozenset(eos),
        name=path.stem,
        source=path,
        context_length=context_length(config),
        quantized=bool(converted.quantization),
        dtype=dtype_name,
        weight_format=_weight_format(converted.quantization, precision, dtype_name),
        generation_config=generation,
    )


def _weight_format(quantized: Mapping[str, object], precision: Precision, dtype: str) -> str:
    if precision.quantize is not None and quantized:
        return precision.quantize.name
    return "gguf-native" if quantized else dtype


def check_float_gguf(gf: GGUFFile, spec: QuantizeSpec) -> None:
    """`--quantize` takes a GGUF of float tensors only; a ValueError names the file's
    quant types otherwise."""
    types = sorted({QT(i.ggml_type).name for i in gf.tensors.values() if not is_float(i.ggml_type)})
    if types:
        raise ValueError(
            f"{gf.path.name} is already quantized ({', '.join(types)} tensors): --quantize "
            f"{spec.name[:2]} quantizes float weights only (a bf16/f16/f32 or FP8 safetensors "
            "folder, or an F16/BF16/F32 GGUF); serve this file without --quantize"
        )


def gguf_generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling a GGUF's metadata recommends, named as in generation_config.json."""
    out: dict[str, Any] = {}
    for key, name in _GGUF_SAMPLING.items():
        value = metadata.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out
