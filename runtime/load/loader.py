"""Load a model for serving: weights into a runtime.models architecture, plus tokenizer,
chat template and the ids that end a generation.

Sources:

1. A HF-style folder: config.json, *.safetensors (sharded or not), tokenizer.json,
   tokenizer_config.json, optionally chat_template.jinja / generation_config.json.
2. An MLX-quantized folder: the same, with config "quantization" (group_size, bits, mode,
   per-module overrides) and weight/scales/biases triplets (runtime/load/quantized.py).
3. A GGUF file of any quant type (config, tokenizer and template from its metadata;
   runtime/load/gguf/loader.py).
4. An FP8 folder (config quantization_config quant_method "fp8", DeepSeek-V3's block
   scales): the fp8 weights decoded at load (runtime/load/fp8.py), and kept quantized as
   MLX 8-bit affine weights.

A folder quantized any other way (quantization_config.quant_method "gptq", "awq",
"bitsandbytes", "compressed-tensors", ... or one we have never heard of) is refused
before any weight is read, with a ValueError naming the method and what to use instead.

Precision policy: on the CPU everything becomes float32 (MLX's CPU backend has fast
float32 matmuls only; bf16 and quantized matmuls are several times slower), so quantized
weights are dequantized at load. On an accelerator quantized weights stay quantized:
MLX triplets as stored; GGUF blocks converted exactly to MLX affine form where one exists
(Q4_0/Q4_1/Q4_K -> 4 bits, Q5_0/Q5_1/Q5_K -> 5 bits, Q8_0 -> 8 bits, all group 32) and
re-quantized otherwise (Q6_K -> 8 bits; see runtime.load.gguf.quants.requantize_bits).

Scales/biases of quantized weights are stored in the compute dtype (quantized matmuls
return the scales' dtype). A shared scale rounded to bfloat16 shifts all 32 weights of a
group together, and those errors add up coherently in a dot product (SmolLM2: greedy
argmax agrees on 84% of positions with float32, against 95% for plain bf16 weights and
100% with float16 scales). So when no dtype is asked for, a quantized GGUF computes in
float16, whose scales are exactly GGUF's; Gemma in float32, because its residual stream
can overflow float16. An MLX-quantized folder computes in the dtype of its own scales.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from runtime import backend
from runtime.load import fp8
from runtime.load.gguf.loader import load_gguf
from runtime.load.loaded import (
    LoadedModel,
    ShardHook,
    context_length,
    finish_model,
    quantize_modules,
    resolve_dtype,
)
from runtime.load.quantized import (
    check_quant_method,
    dequantize_all,
    quant_config,
    quantized_modules,
    scales_dtype,
)
from runtime.models import build_model
from runtime.text import Tokenizer, read_chat_template, token_ids
from runtime.vision.spans import vision_spec

log = logging.getLogger(__name__)


def load(
    source: str | Path,
    *,
    dtype: str | None = None,
    keep_quantized: bool | None = None,
    shard: ShardHook | None = None,
) -> LoadedModel:
    """Load a HF folder, an MLX-quantized folder or a GGUF file (see module docstring).

    ``dtype``: float dtype of the weights (None: float32 on CPU, bfloat16 elsewhere, and
    for weights kept quantized the dtype of their scales, see the module docstring).
    ``keep_quantized``: override the precision policy (None: dequantize on CPU only).
    ``shard``: runs on the loaded, not yet evaluated model (see ShardHook).
    """
    path = Path(source).expanduser()
    if keep_quantized is None:
        keep_quantized = not backend.on_cpu()
    started = time.perf_counter()
    if path.is_file() and path.suffix.lower() == ".gguf":
        loaded = load_gguf(path, dtype, keep_quantized, shard)
    elif path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            loaded = load_gguf(ggufs[0], dtype, keep_quantized, shard)
        else:
            loaded = _load_folder(path, dtype, keep_quantized, shard)
    elif path.exists():
        raise ValueError(f"{path}: expected a model folder or a .gguf file")
    else:
        raise FileNotFoundError(f"model source {path} does not exist")
    seconds = time.perf_counter() - started
    log.info(
        "loaded %s in %.1f s (%s, quantized=%s)", path, seconds, loaded.dtype, loaded.quantized
    )
    return replace(loaded, load_seconds=seconds)


# -- folders ------------------------------------------------------------------------------


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    config = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def _read_weights(files: Iterable[Path]) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            loaded = mx.load(str(file))
        except (RuntimeError, ValueError) as exc:  # MLX names the tensor, not the file
            raise ValueError(f"{file}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{file}: expected a safetensors mapping")
        weights.update(loaded)
    return weights


def _cast_floats(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Float weights to ``dtype``; quantized scales/biases too (they must match inputs).
    MoE routers' score-correction biases stay float32, as transformers keeps them: in
    bfloat16 they can swap which expert wins a near-tie."""
    return {
        k: (
            v.astype(dtype)
            if mx.issubdtype(v.dtype, mx.floating)
            and v.dtype != dtype
            and not k.endswith(_FLOAT32_KEYS)
            else v
        )
        for k, v in weights.items()
    }


_FLOAT32_KEYS = ("e_score_correction_bias",)


def _is_vision(name: str) -> bool:
    return "vision" in name or name.startswith(("visual.", "model.visual."))  # Qwen's: visual


def _without_vision(config: dict[str, Any], weights: Mapping[str, mx.array]) -> dict[str, Any]:
    """A multimodal config whose checkpoint has no vision weights (a text-only
    conversion) builds the text model alone."""
    if "vision_config" not in config or any(_is_vision(name) for name in weights):
        return config
    log.info("the checkpoint has no vision weights: serving the text model only")
    return {k: v for k, v in config.items() if k != "vision_config"}


def _load_folder(
    folder: Path, dtype: str | None, keep_quantized: bool, shard: ShardHook | None = None
) -> LoadedModel:
    config = _read_config(folder)
    check_quant_method(config)
    files = _safetensors_files(folder)
    fp8_format = fp8.fp8_spec(config)  # refuses what it cannot load before reading
    stored = fp8.stored_dtypes(files) if fp8_format is not None else {}
    weights = _read_weights(files)
    quant = quant_config(config)
    dtype_name, mx_dtype = resolve_dtype(
        dtype, scales_dtype(weights) if quant is not None and keep_quantized else None
    )
    if fp8_format is not None:
        weights, quant = _decode_fp8(weights, stored, fp8_format, mx_dtype, keep_quantized)
    model = build_model(_without_vision(config, weights))
    quantized = False
    if quant is not None and not keep_quantized:
        weights = dequantize_all(weights, quant, mx_dtype)
    elif quant is not None:
        # sanitize first: quantized module paths are the model's parameter names
        weights = model.sanitize(weights)
        modules = quantized_modules(weights, quant)
        quantize_modules(model, modules)
        weights = _cast_floats(weights, mx_dtype)
        quantized = bool(modules)
    else:
        weights = _cast_floats(weights, mx_dtype)
    finish_model(model, weights, shard)
    tokenizer = Tokenizer.from_folder(folder)
    generation = _read_generation_config(folder)
    eos = set(tokenizer.eos_token_ids) | set(token_ids(config.get("eos_token_id")))
    eos.update(token_ids(generation.get("eos_token_id")))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        chat_template=read_chat_template(folder),
        eos_token_ids=frozenset(eos),
        name=folder.name,
        source=folder,
        context_length=context_length(config),
        quantized=quantized,
        dtype=dtype_name,
        generation_config=generation,
        vision=vision_spec(model, tokenizer.id_to_token, folder),
    )


def _decode_fp8(
    weights: dict[str, mx.array],
    stored: Mapping[str, str],
    spec: fp8.Fp8Spec,
    dtype: mx.Dtype,
    keep_quantized: bool,
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """An FP8 checkpoint's weights in ``dtype`` (runtime/load/fp8.py); kept quantized, its fp8
    matrices as MLX 8-bit triplets with their quantization config (then loaded as an
    MLX-quantized folder's). The 8-bit grid is fit to the exact float32 products."""
    if not keep_quantized:
        return fp8.dequantize(weights, stored, spec, dtype).weights, None
    converted = fp8.requantize(fp8.dequantize(weights, stored, spec, mx.float32), dtype)
    return converted.weights, converted.quantization


def _read_generation_config(folder: Path) -> dict[str, Any]:
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        log.warning("%s is not valid JSON (%s); ignoring it", file, exc)
        return {}
    return data if isinstance(data, dict) else {}
