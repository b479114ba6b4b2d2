"""FP8 block-scaled safetensors checkpoints (config ``quantization_config`` with
``quant_method: "fp8"``: DeepSeek-V3/R1, Qwen3-*-FP8 and others) -> float weights, or MLX
8-bit affine weights when the loader keeps weights quantized.

Such a checkpoint stores each quantized Linear's ``weight`` as F8_E4M3 and beside it a
``weight_scale_inv`` (float32, bfloat16 or F8_E8M0 powers of two) holding one factor per
``weight_block_size`` block, shape (ceil(out/b0), ceil(in/b1)); the real weight is the
fp8 value times its block's factor (transformers' FineGrainedFP8, DeepSeek's
``weight_dequant``). Without a block size the factor is one per tensor. Modules the
checkpoint left unconverted (``modules_to_not_convert`` / ``ignored_layers``) are stored
as plain floats and pass through: which weights are fp8 is read from the files' headers,
not guessed from those lists.

mx.load reads F8_E4M3 and F8_E8M0 tensors as raw uint8 bytes (and refuses F8_E5M2), so
the safetensors headers say which tensors are fp8; ``mx.from_fp8`` decodes them exactly.
Everything stays lazy: a tensor the model drops (DeepSeek's MTP layer) or a distributed
rank does not keep is never read.

Refused, with a ValueError naming the field or tensor: another ``fmt`` (e5m2), static
activation scales, a block size that is not two positive integers, a scale grid that
does not match its weight and block size, an fp8 weight without its scale.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from runtime.load.affine import affine_quantize
from runtime.load.precision import is_expert_stack

_FP8 = "F8_E4M3"
_E8M0 = "F8_E8M0"  # scale_fmt "ue8m0": one exponent byte, 2 ** (byte - 127)
_UNSUPPORTED_FP8 = frozenset({"F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
_SCALE_SUFFIX = "_scale_inv"  # ``weight`` -> ``weight_scale_inv``
# activation scales of static FP8 (quantized inputs; we compute in float instead)
_ACTIVATION_SUFFIXES = (".input_scale", ".activation_scale", "_activation_scale")
_MAX_HEADER = 1 << 28  # a safetensors header is JSON; DeepSeek-V3's largest is ~2 MB

# When the loader keeps weights quantized: the fp8 weights become MLX affine 8-bit
# (finer than e4m3's 3-bit mantissa for all but the block's smallest values; about a
# quarter of fp8's own rounding error on Gaussian weights), groups of 64 along the input.
REQUANT_BITS = 8
_REQUANT_GROUPS = (64, 32)


@dataclass(frozen=True)
class Fp8Spec:
    """What a checkpoint's quantization_config says about its fp8 weights."""

    block: tuple[int, int] | None  # (rows, cols) per scale; None: one scale per tensor


def _field(name: str) -> str:
    return f"config.json quantization_config.{name}"


def fp8_spec(config: Mapping[str, Any]) -> Fp8Spec | None:
    """The fp8 settings of a HF config, None for a checkpoint that is not FP8; a
    ValueError naming the field for settings we cannot load."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping) or "bits" in (config.get("quantization") or {}):
        return None  # an MLX-quantized folder's "quantization" wins
    if str(quant.get("quant_method", "")).lower() != "fp8":
        return None
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"{_field('fmt')} is {fmt!r}; only e4m3 FP8 weights are supported")
    scheme = quant.get("activation_scheme") or "dynamic"
    if scheme != "dynamic":
        raise ValueError(
            f"{_field('activation_scheme')} is {scheme!r}: static activation scales are "
            "not supported (only 'dynamic', where the weights alone are fp8)"
        )
    return Fp8Spec(_block(quant.get("weight_block_size")))


def _block(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    )
    if not ok:
        raise ValueError(
            f"{_field('weight_block_size')} is {value!r}; expected two positive integers "
            "(rows, columns per scale), e.g. [128, 128]"
        )
    return int(value[0]), int(value[1])


def stored_dtypes(files: Iterable[Path]) -> dict[str, str]:
    """Every tensor's safetensors dtype ("F8_E4M3", "BF16", ...), from the headers only;
    a ValueError naming a tensor in an fp8 format we do not decode."""
    out: dict[str, str] = {}
    for file in files:
        with file.open("rb") as fh:
            head = fh.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= _MAX_HEADER:
                raise ValueError(f"{file}: not a safetensors file")
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = str(entry.get("dtype")) if isinstance(entry, Mapping) else "?"
            if dtype in _UNSUPPORTED_FP8:
                raise ValueError(
                    f"{file}: tensor {name} is {dtype}; only {_FP8} fp8 weights are supported"
                )
            out[name] = dtype
    return out


def _scale_values(name: str, scale: mx.array, dtype: str) -> mx.array:
    """A scale tensor as float32 (F8_E8M0 bytes are powers of two: the byte is the
    float32 exponent field; its extremes, 2**-127 and NaN, become 0 and inf, which no
    checkpoint's scales are)."""
    if dtype == _E8M0:
        return mx.view(scale.astype(mx.uint32) << 23, mx.float32)
    if not mx.issubdtype(scale.dtype, mx.floating):
        raise ValueError(f"tensor {name} is {dtype}; expected float scales")
    return scale.astype(mx.float32)


def _grid(spec: Fp8Spec, name: str, weight: mx.array, scale: mx.array) -> tuple[int, int]:
    """The blocks per axis; the scale must have exactly that grid (leading axes: stacked
    experts) or, without a block size, one element."""
    rows, cols = weight.shape[-2:] if weight.ndim >= 2 else (1, weight.size)
    if spec.block is None:
        if scale.size != 1:
            raise ValueError(
                f"{name}: shape {tuple(scale.shape)} for {tuple(weight.shape)} weights, but "
                f"{_field('weight_block_size')} is not set (one scale per tensor)"
            )
        return 1, 1
    grid = (-(-rows // spec.block[0]), -(-cols // spec.block[1]))
    if weight.ndim < 2 or tuple(scale.shape) != (*weight.shape[:-2], *grid):
        raise ValueError(
            f"{name}: shape {tuple(scale.shape)} does not fit {tuple(weight.shape)} fp8 "
            f"weights in {_field('weight_block_size')} {list(spec.block)} blocks "
            f"(expected {(*weight.shape[:-2], *grid)})"
        )
    return grid


def dequantize_block(values: mx.array, scale: mx.array, block: tuple[int, int] | None) -> mx.array:
    """float32 ``values`` (…, rows, cols) times their block's factor of ``scale``
    (…, ceil(rows/b0), ceil(cols/b1)); the last blocks may be partial."""
    if block is None:
        return values * scale.reshape(())
    *lead, rows, cols = values.shape
    (b0, b1), (g0, g1) = block, scale.shape[-2:]
    padding = [(0, 0)] * len(lead) + [(0, g0 * b0 - rows), (0, g1 * b1 - cols)]
    padded = mx.pad(values, padding) if (g0 * b0, g1 * b1) != (rows, cols) else values
    blocks = padded.reshape(*lead, g0, b0, g1, b1) * scale[..., :, None, :, None]
    return blocks.reshape(*lead, g0 * b0, g1 * b1)[..., :rows, :cols]


@dataclass
class Fp8Weights:
    """The checkpoint's weights with the fp8 ones decoded (scales dropped), and for the
    quantized path the MLX quantization config of the re-quantized modules."""

    weights: dict[str, mx.array]
    fp8_names: list[str]
    quantization: dict[str, Any] | None = None


def dequantize(
    weights: Mapping[str, mx.array],
    dtypes: Mapping[str, str],
    spec: Fp8Spec,
    dtype: mx.Dtype,
) -> Fp8Weights:
    """Every fp8 tensor of ``weights`` times its scales, in ``dtype`` (the product is
    taken in float32, then rounded once); scales dropped, the rest unchanged."""
    _refuse_activation_scales(weights)
    out: dict[str, mx.array] = {}
    fp8: list[str] = []
    for name, value in weights.items():
        if name.endswith(_SCALE_SUFFIX):
            base = name.removesuffix(_SCALE_SUFFIX)
            if dtypes.get(base) != _FP8:
                raise ValueError(f"{name}: a scale for {base}, which is not {_FP8}")
            continue
        if dtypes.get(name) != _FP8:
            out[name] = value
            continue
        scale_name = name + _SCALE_SUFFIX
        if scale_name not in weights:
            raise ValueError(f"{name} is {_FP8} but the checkpoint has no {scale_name}")
        scale = _scale_values(scale_name, weights[scale_name], dtypes.get(scale_name, ""))
        _grid(spec, scale_name, value, scale)
        values = mx.from_fp8(value, dtype=mx.float32)
        out[name] = dequantize_block(values, scale, spec.block).astype(dtype)
        fp8.append(name)
    return Fp8Weights(out, fp8)


def _router(name: str) -> bool:
    return name.endswith(".mlp.gate.weight")


def _refuse_activation_scales(weights: Iterable[str]) -> None:
    found = next((n for n in weights if n.endswith(_ACTIVATION_SUFFIXES)), None)
    if found is not None:
        raise ValueError(
            f"{found}: static activation scales are not supported (the checkpoint's "
            f"{_field('activation_scheme')} should be 'dynamic', with fp8 weights only)"
        )


def requantize(
    converted: Fp8Weights, scales_dtype: mx.Dtype, *, experts: bool = True
) -> Fp8Weights:
    """The decoded fp8 matrices (``*.weight``, 2-D: Linear layers and, with ``experts``,
    per-expert projections) as MLX affine ``REQUANT_BITS``-bit triplets (the min-max grid
    of runtime/load/affine.py, scales/biases in ``scales_dtype``) in an MLX-quantized
    folder's names, with its ``quantization`` config; one group size for all (the largest
    of 64, 32 dividing every input width); the rest (vectors, stacked tensors, widths
    no group divides, MoE routers: routing is precision-sensitive) stay float."""
    names = [n for n in converted.fp8_names if n.endswith(".weight") and not _router(n)]
    names = [n for n in names if converted.weights[n].ndim == 2]
    names = [n for n in names if experts or not is_expert_stack(n)]
    widths = {int(converted.weights[n].shape[-1]) for n in names}
    group = next((g for g in _REQUANT_GROUPS if all(w % g == 0 for w in widths)), 32)
    weights = dict(converted.weights)
    count = 0
    for name in names:
        if weights[name].shape[-1] % group:
            continue
        module = name.removesuffix(".weight")
        q, scales, biases = affine_quantize(
            weights[name], group_size=group, bits=REQUANT_BITS, scales_dtype=scales_dtype
        )
        weights[name] = q
        weights[f"{module}.scales"] = scales
        weights[f"{module}.biases"] = biases
        count += 1
    quant = {"bits": REQUANT_BITS, "group_size": group, "mode": "affine"} if count else None
    return Fp8Weights(weights, converted.fp8_names, quant)
