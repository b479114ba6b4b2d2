"""Load a model for serving: weights into a runtime.models architecture, plus tokenizer,
chat template and the ids that end a generation.

Sources:

1. A HF-style folder: config.json, *.safetensors (sharded or not), tokenizer.json,
   tokenizer_config.json, optionally chat_template.jinja / generation_config.json.
2. An MLX-quantized folder: the same, with config "quantization" (group_size, bits, mode,
   per-module overrides) and weight/scales/biases triplets.
3. A GGUF file of any quant type (config, tokenizer and template from its metadata).
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
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.quantized import quantize as quantize_modules

from runtime import backend
from runtime.load import fp8
from runtime.models import build_model
from runtime.models.base import LanguageModel
from runtime.models.linear import choose_small_gemm
from runtime.text.tokenizer import Tokenizer, read_chat_template
from runtime.vision.preprocess import VisionSpec
from runtime.vision.spans import vision_spec

log = logging.getLogger(__name__)

_DTYPES: Mapping[str, mx.Dtype] = {
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
    load_seconds: float = 0.0
    # generation_config.json as the model's authors wrote it (a GGUF's general.sampling.*
    # metadata under the same names): their recommended sampling, among other things
    generation_config: Mapping[str, Any] = field(default_factory=dict)
    # for a vision model: its image placeholder and preprocessing; None for text models
    vision: VisionSpec | None = None


def resolve_dtype(dtype: str | None, default: str | None = None) -> tuple[str, mx.Dtype]:
    """A dtype name and its MLX dtype; None means ``default``, else the backend's."""
    name = dtype or default or backend.default_dtype_name()
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return name, _DTYPES[name]


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
        loaded = _load_gguf(path, dtype, keep_quantized, shard)
    elif path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            loaded = _load_gguf(ggufs[0], dtype, keep_quantized, shard)
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


# -- helpers shared by both source kinds --------------------------------------------------


def _int_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _end_of_turn_ids(tokenizer: Tokenizer) -> list[int]:
    ids = (tokenizer.token_to_id(tok) for tok in END_OF_TURN_TOKENS)
    return [i for i in ids if i is not None]


def _context_length(config: Mapping[str, Any]) -> int:
    text = config.get("text_config")
    for cfg in (config, text if isinstance(text, Mapping) else {}):
        value = cfg.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return _DEFAULT_CONTEXT


def _finish(
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
    choose_small_gemm(model)


def _quantize_modules(model: LanguageModel, params: Mapping[str, Mapping[str, Any]]) -> None:
    """Swap the listed modules for their quantized versions (with their own bits)."""

    def predicate(path: str, module: Module) -> bool | dict[str, Any]:
        spec = params.get(path)
        if spec is None or not hasattr(module, "to_quantized"):
            return False
        return dict(spec)

    quantize_modules(model, class_predicate=predicate)  # type: ignore[arg-type]


# -- GGUF ---------------------------------------------------------------------------------


def _load_gguf(
    path: Path, dtype: str | None, keep_quantized: bool, shard: ShardHook | None = None
) -> LoadedModel:
    from runtime.load.gguf.config import hf_config
    from runtime.load.gguf.names import convert_weights
    from runtime.load.gguf.reader import GGUFFile

    gf = GGUFFile(path)
    config = hf_config(gf)
    default = None
    if keep_quantized:
        default = "float32" if gf.architecture.startswith("gemma") else "float16"
    dtype_name, mx_dtype = resolve_dtype(dtype, default)
    # The tokenizer build is mostly Python (GIL-bound) and the weight conversion mostly
    # numpy (GIL-free): overlapping them hides most of the tokenizer's time.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(Tokenizer.from_gguf, gf)
        converted = convert_weights(gf, config, dtype=mx_dtype, keep_quantized=keep_quantized)
        tokenizer = pending.result()
    model = build_model(config)
    if converted.quantization:
        _quantize_modules(model, converted.quantization)
    _finish(model, converted.weights, shard)
    template = gf.get("tokenizer.chat_template")
    generation = gguf_generation_config(gf.metadata)
    # A GGUF names one eos id; chat turns end with the vocabulary's end-of-turn token
    # (a base model without a template may still be prompted in its chat format).
    eos = set(tokenizer.eos_token_ids) | set(_int_ids(config.get("eos_token_id")))
    eos.update(_end_of_turn_ids(tokenizer))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        chat_template=str(template) if template else None,
        eos_token_ids=frozenset(eos),
        name=path.stem,
        source=path,
        context_length=_context_length(config),
        quantized=bool(converted.quantization),
        dtype=dtype_name,
        generation_config=generation,
    )


# gguf-py's Keys.General.SAMPLING_* (written by convert_hf_to_gguf.py from
# generation_config.json) -> generation_config.json's own names
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def gguf_generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling a GGUF's metadata recommends, named as in generation_config.json."""
    out: dict[str, Any] = {}
    for key, name in _GGUF_SAMPLING.items():
        value = metadata.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


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


# quantization_config.quant_method values a folder may carry: "fp8" (runtime/load/fp8.py) and
# "mlx", some converters' name for MLX triplets (mlx-lm writes no method at all)
_QUANT_METHODS = frozenset({"fp8", "mlx"})
_INSTEAD = (
    "use an unquantized (bfloat16/float16) safetensors folder, an MLX-quantized folder "
    "(mlx-community's, or made with mlx_lm.convert -q), an FP8 block-scaled checkpoint "
    "(quant_method 'fp8') or a GGUF file"
)


def _check_quant_method(config: Mapping[str, Any]) -> None:
    """A ValueError for a checkpoint quantized by a method we cannot load, before any
    weight is read: its tensors would otherwise fail as strays, or load as something
    else (GPTQ's config has "bits" too). An MLX folder's "quantization" wins over a
    leftover quantization_config, as in runtime/load/fp8.py."""
    quant = config.get("quantization_config")
    mlx_quant = config.get("quantization")
    if not isinstance(quant, Mapping) or (isinstance(mlx_quant, Mapping) and "bits" in mlx_quant):
        return
    method = quant.get("quant_method")
    if not method and (quant.get("load_in_4bit") or quant.get("load_in_8bit")):
        # written before transformers named its methods: bitsandbytes
        raise ValueError(
            "config.json quantization_config has load_in_4bit/load_in_8bit: "
            f"bitsandbytes-quantized checkpoints are not supported; {_INSTEAD}"
        )
    name = str(method or "").lower()
    if not name or name in _QUANT_METHODS:
        return
    formats = sorted(_compressed_formats(quant)) if name == "compressed-tensors" else []
    detail = f" (format {', '.join(map(repr, formats))})" if formats else ""
    if "float-quantized" in formats:  # fp8, but not in the layout runtime/load/fp8.py reads
        detail = detail[:-1] + ": compressed-tensors' fp8 layout, not quant_method 'fp8')"
    raise ValueError(
        f"config.json quantization_config.quant_method is {method!r}{detail}: checkpoints "
        f"quantized with {method} are not supported; {_INSTEAD}"
    )


def _compressed_formats(quant: Mapping[str, Any]) -> set[str]:
    """A compressed-tensors config's weight formats: its own, or its groups'."""
    groups = quant.get("config_groups")
    values = [quant.get("format")]
    if isinstance(groups, Mapping):
        values += [g.get("format") for g in groups.values() if isinstance(g, Mapping)]
    return {str(v) for v in values if v}


def _quant_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, Mapping) or "bits" not in quant:
        return None
    return dict(quant)


def _module_quant(quant: Mapping[str, Any], module: str) -> dict[str, Any]:
    """The quantization of one module: its override, else the global setting."""
    base = {
        "group_size": int(quant.get("group_size", 64)),
        "bits": int(quant["bits"]),
        "mode": str(quant.get("mode", "affine")),
    }
    override = quant.get(module)
    if not isinstance(override, Mapping):
        # converted multimodal checkpoints key overrides by their own module paths
        # (``language_model.model.layers...``), which sanitize shortens
        suffix = f".{module}"
        override = next(
            (v for k, v in quant.items() if isinstance(v, Mapping) and k.endswith(suffix)), None
        )
    if isinstance(override, Mapping):
        base.update({k: override[k] for k in ("group_size", "bits", "mode") if k in override})
    return base


def _dequantize_all(
    weights: dict[str, mx.array], quant: Mapping[str, Any], dtype: mx.Dtype
) -> dict[str, mx.array]:
    """Replace every weight/scales/biases triplet by its float weight."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and f"{module}.scales" in weights:
            spec = _module_quant(quant, module)
            value = mx.dequantize(
                value,
                weights[f"{module}.scales"],
                weights.get(f"{module}.biases"),
                group_size=spec["group_size"],
                bits=spec["bits"],
                mode=spec["mode"],
            )
        out[name] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
    return out


def _quantized_modules(
    weights: Mapping[str, mx.array], quant: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    modules = (n[: -len(".scales")] for n in weights if n.endswith(".scales"))
    return {m: _module_quant(quant, m) for m in modules}


def _scales_dtype(weights: Mapping[str, mx.array]) -> str | None:
    """The dtype a quantized checkpoint stored its scales in (its natural compute dtype)."""
    for name, value in weights.items():
        if name.endswith(".scales"):
            for dtype_name, dtype in _DTYPES.items():
                if value.dtype == dtype:
                    return dtype_name
    return None


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
    _check_quant_method(config)
    files = _safetensors_files(folder)
    fp8_format = fp8.fp8_spec(config)  # refuses what it cannot load before reading
    stored = fp8.stored_dtypes(files) if fp8_format is not None else {}
    weights = _read_weights(files)
    quant = _quant_config(config)
    dtype_name, mx_dtype = resolve_dtype(
        dtype, _scales_dtype(weights) if quant is not None and keep_quantized else None
    )
    if fp8_format is not None:
        weights, quant = _decode_fp8(weights, stored, fp8_format, mx_dtype, keep_quantized)
    model = build_model(_without_vision(config, weights))
    quantized = False
    if quant is not None and not keep_quantized:
        weights = _dequantize_all(weights, quant, mx_dtype)
    elif quant is not None:
        # sanitize first: quantized module paths are the model's parameter names
        weights = model.sanitize(weights)
        modules = _quantized_modules(weights, quant)
        _quantize_modules(model, modules)
        weights = _cast_floats(weights, mx_dtype)
        quantized = bool(modules)
    else:
        weights = _cast_floats(weights, mx_dtype)
    _finish(model, weights, shard)
    tokenizer = Tokenizer.from_folder(folder)
    generation = _read_generation_config(folder)
    eos = set(tokenizer.eos_token_ids) | set(_int_ids(config.get("eos_token_id")))
    eos.update(_int_ids(generation.get("eos_token_id")))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        chat_template=read_chat_template(folder),
        eos_token_ids=frozenset(eos),
        name=folder.name,
        source=folder,
        context_length=_context_length(config),
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
