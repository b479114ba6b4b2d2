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

Precision policy (runtime/load/precision.py). Quantized weights stay quantized wherever
quantized matmuls are fast: on an accelerator, and on the CPU once runtime.kernels'
extension is loaded (`quantized_ready`; without it the CPU dequantizes everything to
float32, since MLX's own CPU quantized matmul is a scalar single-thread loop).

- The CPU computes in float32 (its fast matmuls and our kernels take float32 inputs).
  Scales/biases are stored as float16 where that is exact for the source (GGUF's legacy
  types Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, checked per tensor), as float32 where it is not (Q4_K,
  Q5_K: measured in runtime/load/gguf/quants.py), as stored for an MLX-quantized folder,
  and as float16 for weights re-quantized at load (the grid is fit to them:
  runtime/load/affine.py). Every MLX width has an int8 decode kernel on the CPU
  (runtime/kernels/qdot.c), so GGUF's 5-bit types stay 5-bit; types with no exact affine form (Q6_K, Q2_K, Q3_K, IQ*) are re-quantized to
  8 bits. Stacked MoE experts (SwitchLinear) are dequantized to float32 (MLX's CPU
  gather_qmm is a scalar loop too; one log line says so); ``keep_quantized=True`` keeps
  them quantized.
- On an accelerator GGUF blocks convert exactly to MLX affine form where one exists
  (Q4_0/Q4_1/Q4_K -> 4 bits, Q5_0/Q5_1/Q5_K -> 5 bits, Q8_0 -> 8 bits, all group 32) and
  are re-quantized otherwise (runtime.load.gguf.quants.requantize_bits). Scales/biases
  there are stored in the compute dtype (quantized matmuls return the scales' dtype). A
  shared scale rounded to bfloat16 shifts all 32 weights of a group together, and those
  errors add up coherently in a dot product (SmolLM2: greedy argmax agrees on 84% of
  positions with float32, against 95% for plain bf16 weights and 100% with float16
  scales). So when no dtype is asked for, a quantized GGUF computes in float16, whose
  scales are exactly GGUF's; Gemma in float32, because its residual stream can overflow
  float16. An MLX-quantized folder computes in the dtype of its own scales.
- Embeddings stay quantized like any other 2-D weight (QuantizedEmbedding: a lookup
  dequantizes the rows it reads; a tied head multiplies through the quantized matmul).

``quantize`` (`--quantize q4|q8`, runtime.load.precision.QuantizeSpec) quantizes a float
source at load: a bf16/f16/f32 or FP8 folder, or a GGUF whose tensors are all float. Every
Linear of the language model whose input width the group divides becomes affine 4 or 8
bits; the token embeddings and the output head 8 bits under q4; vision towers and MoE
routers stay float. An already-quantized source is refused with a ValueError naming what
it is (`check_quantize` says so before loading).
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

from runtime.backend import trim_heap
from runtime.load import fp8
from runtime.load.gguf.loader import check_float_gguf, load_gguf
from runtime.load.gguf.reader import GGUFFile
from runtime.load.gguf.tokenizer import tokenizer_from_gguf
from runtime.load.loaded import (
    LoadedModel,
    ShardHook,
    context_length,
    finish_model,
    quantize_modules,
    resolve_dtype,
)
from runtime.load.precision import (
    Precision,
    QuantizeSpec,
    is_vision,
    log_dequantized_experts,
    quantize_weights,
)
from runtime.load.quantized import (
    check_quant_method,
    dequantize_all,
    dequantize_modules,
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
    quantize: QuantizeSpec | None = None,
    shard: ShardHook | None = None,
    mtp: bool = False,
) -> LoadedModel:
    """Load a HF folder, an MLX-quantized folder or a GGUF file (see module docstring).

    ``dtype``: compute dtype (None: float32 on CPU; elsewhere bfloat16, or for weights
    kept quantized the dtype of their scales, see the module docstring).
    ``keep_quantized``: override the precision policy (None: keep quantized weights
    quantized where quantized matmuls are fast; True also keeps MoE experts quantized on
    the CPU). ``quantize``: quantize a float source's weights at load (`--quantize`).
    ``shard``: runs on the loaded, not yet evaluated model (see ShardHook).
    ``mtp``: keep the multi-token-prediction layer (`--speculative mtp`; a folder's
    only: runtime/models/mtp.py), a ValueError naming the model where it has none.
    """
    path = Path(source).expanduser()
    precision = Precision.choose(keep_quantized, quantize)
    started = time.perf_counter()
    gguf = _gguf_file(path)
    if gguf is not None and mtp:
        raise ValueError(f"{path.name}: --speculative mtp drafts from safetensors folders only")
    if gguf is not None:
        loaded = load_gguf(gguf, dtype, precision, shard)
    elif path.is_dir():
        try:
            loaded = _load_folder(path, dtype, precision, shard, mtp)
        except ValueError as exc:
            if not mtp or "--speculative mtp" not in str(exc):
                raise
            raise ValueError(f"{path.name}: {exc}") from None
    elif path.exists():
        raise ValueError(f"{path}: expected a model folder or a .gguf file")
    else:
        raise FileNotFoundError(f"model source {path} does not exist")
    trim_heap()
    seconds = time.perf_counter() - started
    log.info(
        "loaded %s in %.1f s (%s, weights %s)", path, seconds, loaded.dtype, loaded.weight_format
    )
    return replace(loaded, load_seconds=seconds)


def check_quantize(source: str | Path, spec: QuantizeSpec) -> None:
    """A ValueError when `--quantize` makes no sense for ``source`` (already quantized:
    the message says how), read from its config or GGUF header only: a server refuses at
    startup, not at the first load."""
    path = Path(source).expanduser()
    gguf = _gguf_file(path)
    if gguf is not None:
        check_float_gguf(GGUFFile(gguf), spec)
    elif (path / "config.json").is_file():
        _check_float_folder(path, _read_config(path), spec)


def load_tokenizer(source: str | Path) -> Tokenizer:
    """A model source's tokenizer alone, no weights read (a folder's tokenizer files, a
    GGUF's metadata): what a server checks at startup."""
    path = Path(source).expanduser()
    gguf = _gguf_file(path)
    if gguf is not None:
        return tokenizer_from_gguf(GGUFFile(gguf))
    return Tokenizer.from_folder(path)


def _gguf_file(path: Path) -> Path | None:
    """The GGUF file a source names: the file, or a folder's only .gguf (no config.json)."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def _check_float_folder(folder: Path, config: Mapping[str, Any], spec: QuantizeSpec) -> None:
    check_quant_method(config)
    quant = quant_config(config)
    if quant is None:
        return
    raise ValueError(
        f"{folder.name} is already MLX-quantized ({quant['bits']}-bit, group "
        f"{quant.get('group_size', 64)}): --quantize {spec.name[:2]} quantizes float weights "
        "only (a bf16/f16/f32 or FP8 safetensors folder, or an F16/BF16/F32 GGUF); serve "
        "this folder without --quantize"
    )


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


def _cast_floats(
    weights: dict[str, mx.array], dtype: mx.Dtype, *, keep_scales: bool = False
) -> dict[str, mx.array]:
    """Float weights to ``dtype``; quantized scales/biases too (they must match inputs),
    unless ``keep_scales`` (the CPU's layout: runtime/load/precision.py). MoE routers'
    score-correction biases stay float32, as transformers keeps them: in bfloat16 they can
    swap which expert wins a near-tie."""
    kept = _FLOAT32_KEYS + ((".scales", ".biases") if keep_scales else ())
    return {
        k: (
            v.astype(dtype)
            if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and not k.endswith(kept)
            else v
        )
        for k, v in weights.items()
    }


_FLOAT32_KEYS = ("e_score_correction_bias",)


def _without_vision(config: dict[str, Any], weights: Mapping[str, mx.array]) -> dict[str, Any]:
    """A multimodal config whose checkpoint has no vision weights (a text-only
    conversion) builds the text model alone."""
    if "vision_config" not in config or any(is_vision(name) for name in weights):
        return config
    log.info("the checkpoint has no vision weights: serving the text model only")
    return {k: v for k, v in config.items() if k != "vision_config"}


def _load_folder(
    folder: Path,
    dtype: str | None,
    precision: Precision,
    shard: ShardHook | None = None,
    mtp: bool = False,
) -> LoadedModel:
    config = _read_config(folder)
    check_quant_method(config)
    if precision.quantize is not None:
        _check_float_folder(folder, config, precision.quantize)
    files = _safetensors_files(folder)
    fp8_format = fp8.fp8_spec(config)  # refuses what it cannot load before reading
    stored = fp8.stored_dtypes(files) if fp8_format is not None else {}
    weights = _read_weights(files)
    quant = quant_config(config)
    keep = precision.keep_quantized and precision.quantize is None
    # on accelerators a quantized folder computes in its scales' dtype; the CPU in float32
    by_scales = quant is not None and keep and not precision.cpu
    dtype_name, mx_dtype = resolve_dtype(dtype, scales_dtype(weights) if by_scales else None)
    fmt = dtype_name
    if fp8_format is not None:
        weights, quant = _decode_fp8(weights, stored, fp8_format, mx_dtype, precision)
        fmt = f"fp8-q8g{quant['group_size']}" if quant is not None else fmt
    model = build_model(_without_vision(config, weights), mtp=mtp)
    modules: dict[str, dict[str, Any]] = {}
    if quant is not None and not precision.keep_quantized:
        weights = dequantize_all(weights, quant, mx_dtype)
    elif quant is not None:
        # sanitize first: quantized module paths are the model's parameter names
        weights = model.sanitize(weights)
        modules = quantized_modules(weights, quant)
        weights = _dequantize_experts(weights, modules, precision, mx_dtype)
        quantize_modules(model, modules)
        weights = _cast_floats(weights, mx_dtype, keep_scales=precision.cpu)
        fmt = fmt if fp8_format is not None else "mlx-native"
    elif precision.quantize is not None:
        weights = model.sanitize(weights)
        modules = quantize_weights(model, weights, precision, mx_dtype)
        quantize_modules(model, modules)
        weights = _cast_floats(weights, mx_dtype, keep_scales=True)
        fmt = precision.quantize.name
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
        quantized=bool(modules),
        dtype=dtype_name,
        weight_format=fmt if modules else dtype_name,
        generation_config=generation,
        vision=vision_spec(model, tokenizer.id_to_token, folder),
    )


def _decode_fp8(
    weights: dict[str, mx.array],
    stored: Mapping[str, str],
    spec: fp8.Fp8Spec,
    dtype: mx.Dtype,
    precision: Precision,
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """An FP8 checkpoint's weights in ``dtype`` (runtime/load/fp8.py); kept quantized (and
    not re-quantized by `--quantize`), its fp8 matrices as MLX 8-bit triplets with their
    quantization config (then loaded as an MLX-quantized folder's). The 8-bit grid is fit
    to the exact float32 products."""
    if not precision.keep_quantized or precision.quantize is not None:
        return fp8.dequantize(weights, stored, spec, dtype).weights, None
    converted = fp8.requantize(
        fp8.dequantize(weights, stored, spec, mx.float32),
        precision.requantized_scales_dtype(dtype),
        experts=precision.experts_quantized,
    )
    return converted.weights, converted.quantization


def _dequantize_experts(
    weights: dict[str, mx.array],
    modules: dict[str, dict[str, Any]],
    precision: Precision,
    dtype: mx.Dtype,
) -> dict[str, mx.array]:
    """Stacked experts (3-D) leave ``modules`` as floats when the policy says so."""
    if precision.experts_quantized:
        return weights
    stacks = {m: spec for m, spec in modules.items() if weights[f"{m}.weight"].ndim == 3}
    for module in stacks:
        del modules[module]
    log_dequantized_experts(len(stacks))
    return dequantize_modules(weights, stacks, dtype) if stacks else weights


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
