"""Quantized folders: refusing methods we cannot load, each module's quantization, and
the two ways to load MLX weight/scales/biases triplets (dequantized, or kept with their
modules swapped for quantized ones; runtime/load/loader.py chooses by the backend)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from runtime.load.loaded import DTYPES

# quantization_config.quant_method values a folder may carry: "fp8" (runtime/load/fp8.py) and
# "mlx", some converters' name for MLX triplets (mlx-lm writes no method at all)
_QUANT_METHODS = frozenset({"fp8", "mlx"})
_INSTEAD = (
    "use an unquantized (bfloat16/float16) safetensors folder, an MLX-quantized folder "
    "(mlx-community's, or made with mlx_lm.convert -q), an FP8 block-scaled checkpoint "
    "(quant_method 'fp8') or a GGUF file"
)


def check_quant_method(config: Mapping[str, Any]) -> None:
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


def quant_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
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


def dequantize_all(
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


def dequantize_modules(
    weights: dict[str, mx.array], modules: Mapping[str, Mapping[str, Any]], dtype: mx.Dtype
) -> dict[str, mx.array]:
    """``weights`` with the triplets of ``modules`` (path -> bits, group_size, mode)
    replaced by their float weights in ``dtype``."""
    out = dict(weights)
    for module, spec in modules.items():
        out[f"{module}.weight"] = mx.dequantize(
            out[f"{module}.weight"],
            out.pop(f"{module}.scales"),
            out.pop(f"{module}.biases", None),
            group_size=int(spec["group_size"]),
            bits=int(spec["bits"]),
            mode=str(spec.get("mode", "affine")),
        ).astype(dtype)
    return out


def quantized_modules(
    weights: Mapping[str, mx.array], quant: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    modules = (n[: -len(".scales")] for n in weights if n.endswith(".scales"))
    return {m: _module_quant(quant, m) for m in modules}


def scales_dtype(weights: Mapping[str, mx.array]) -> str | None:
    """The dtype a quantized checkpoint stored its scales in (its natural compute dtype)."""
    for name, value in weights.items():
        if name.endswith(".scales"):
            for dtype_name, dtype in DTYPES.items():
                if value.dtype == dtype:
                    return dtype_name
    return None
