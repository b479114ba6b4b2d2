"""Decoding one GGUF tensor into what an MLX model loads: float arrays, or the affine
(weight, scales, biases) triplet of a weight that stays quantized (runtime/load/gguf/names.py
chooses the names and transforms, and runs this over every tensor)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from runtime.load.affine import affine_quantize
from runtime.load.gguf.moe_names import FLOAT32_SUFFIX, GATE_UP, GATE_UP_PARTS
from runtime.load.gguf.quants import (
    GROUP,
    Affine,
    dequantize,
    is_float,
    requantize_bits,
    to_affine,
)
from runtime.load.gguf.reader import GGUFFile, TensorInfo
from runtime.load.precision import Precision


@dataclass(frozen=True)
class Transform:
    """What llama.cpp's converter did to a tensor that loading undoes."""

    rows: np.ndarray | None = None  # row permutation
    minus_one: bool = False


@dataclass
class ConvertedWeights:
    """HF-named arrays, and for quantized modules their ``{"bits", "group_size"}``."""

    weights: dict[str, mx.array] = field(default_factory=dict)
    quantization: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    dequantized_experts: int = 0  # quantized expert stacks loaded as floats (CPU policy)


@dataclass(frozen=True)
class Plan:
    """How to convert: the compute dtype, the precision policy, and the modules
    `--quantize` quantizes (module path -> bits; empty without it)."""

    dtype: mx.Dtype
    precision: Precision
    targets: Mapping[str, int] = field(default_factory=dict)


def float_tensor(gf: GGUFFile, info: TensorInfo, tf: Transform) -> np.ndarray:
    """The tensor as float32, with ``tf`` undone."""
    values = dequantize(gf.raw(info.name), info.ggml_type, info.shape)
    if tf.rows is not None:
        values = values[tf.rows]
    if tf.minus_one:
        values = values - np.float32(1.0)
    return values


def is_expert_stack(info: TensorInfo, name: str) -> bool:
    return len(info.shape) == 3 and ".switch_mlp." in name


def keep_quantized(info: TensorInfo, name: str) -> bool:
    """Weights of quantized types stay quantized where a quantized module can take them:
    2-D (Linear, Embedding) and stacked experts (SwitchLinear). Routers stay float (a
    sigmoid router has no quantized form, and routing is precision-sensitive)."""
    if (
        not name.endswith(".weight")
        or is_float(info.ggml_type)
        or name.endswith(".mlp.gate.weight")
    ):
        return False
    return len(info.shape) == 2 or is_expert_stack(info, name)


@dataclass(frozen=True)
class Decoded:
    """One tensor decoded in numpy (worker threads); MLX arrays are made on the caller's
    thread, since MLX streams are per thread."""

    name: str
    values: np.ndarray | None = None  # float32
    affine: Affine | None = None
    requantize_bits: int | None = None  # quantize ``values`` to this many bits
    group_size: int = GROUP  # ... in groups of this many
    dequantized_expert: bool = False  # a quantized expert stack loaded as floats


def decode_tensor(gf: GGUFFile, info: TensorInfo, name: str, tf: Transform, plan: Plan) -> Decoded:
    """``info``'s values under HF ``name``, transformed: as an MLX affine form where the
    weight stays quantized, float32 values to re-quantize where it has no exact affine
    form or `--quantize` takes it, else float32 values (runs on worker threads)."""
    precision = plan.precision
    if precision.keep_quantized and keep_quantized(info, name):
        if is_expert_stack(info, name) and not precision.experts_quantized:
            return Decoded(name, values=float_tensor(gf, info, tf), dequantized_expert=True)
        affine = to_affine(gf.raw(info.name), info.ggml_type)
        if affine is not None:
            affine = affine if tf.rows is None else affine.take_rows(tf.rows)
            return Decoded(name, affine=affine)
        # No exact affine form (Q6_K, Q2_K, IQ*): dequantize, re-quantize finely.
        bits = 8 if precision.cpu else requantize_bits(info.ggml_type)
        return Decoded(name, values=float_tensor(gf, info, tf), requantize_bits=bits)
    target = _target_bits(name, plan)
    if target is not None and precision.quantize is not None:
        values = float_tensor(gf, info, tf)
        group = precision.quantize.group_size
        return Decoded(name, values=values, requantize_bits=target, group_size=group)
    return Decoded(name, values=float_tensor(gf, info, tf))


def _target_bits(name: str, plan: Plan) -> int | None:
    """The bits `--quantize` gives the module of weight ``name`` (fused experts: their
    halves'), or None when it stays float."""
    stem = name.removesuffix(GATE_UP)
    names = [stem + part for part in GATE_UP_PARTS] if stem != name else [name]
    bits = {plan.targets.get(n.removesuffix(".weight")) for n in names if n.endswith(".weight")}
    return bits.pop() if len(bits) == 1 else None


def split_gate_up(item: Decoded) -> list[Decoded]:
    """Fused experts (``ffn_gate_up_exps``, (experts, 2 * width, embedding)) as the gate
    (first rows of each expert) and up stacks; anything else as it is. GGML blocks run
    along the embedding axis, so a quantized tensor splits between rows exactly, its
    affine form (or values to re-quantize) included."""
    if not item.name.endswith(GATE_UP):
        return [item]
    stem = item.name.removesuffix(GATE_UP)
    names = [stem + part for part in GATE_UP_PARTS]
    if item.affine is not None:
        a = item.affine
        weights, scales, biases = (np.split(x, 2, axis=1) for x in (a.weight, a.scales, a.biases))
        return [
            dataclasses.replace(
                item,
                name=name,
                affine=Affine(weights[i], scales[i], biases[i], a.bits, a.group_size),
            )
            for i, name in enumerate(names)
        ]
    assert item.values is not None
    values = np.split(item.values, 2, axis=1)
    return [
        dataclasses.replace(item, name=name, values=v)
        for name, v in zip(names, values, strict=True)
    ]


# float32 values re-quantized at a time (64 MB): a whole 7B head (152064 x 3584, 2.2 GB in
# float32) made several full-size temporaries at once, 1.3 GB of the load's peak
REQUANTIZE_VALUES = 1 << 24


def requantized(
    values: np.ndarray, group: int, bits: int, scales_dtype: mx.Dtype
) -> tuple[mx.array, mx.array, mx.array]:
    """`affine_quantize` of float32 `values` (..., n), evaluated, a slice of rows at a
    time: every group lies in one row, so the slices' triplets are the whole's."""
    flat = values.reshape(-1, values.shape[-1])
    step = max(1, REQUANTIZE_VALUES // flat.shape[1])
    parts: list[tuple[mx.array, mx.array, mx.array]] = []
    for start in range(0, flat.shape[0], step):
        part = affine_quantize(
            mx.array(flat[start : start + step]),
            group_size=group,
            bits=bits,
            scales_dtype=scales_dtype,
        )
        mx.eval(*part)  # lets go of the slice's float32 values now
        parts.append(part)
    lead = values.shape[:-1]
    joined = [
        mx.concatenate([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(3)
    ]
    out = tuple(a.reshape(*lead, a.shape[-1]) for a in joined)
    mx.eval(*out)
    return out[0], out[1], out[2]


def store(out: ConvertedWeights, item: Decoded, plan: Plan) -> None:
    """Add ``item`` to ``out`` as MLX arrays (on the caller's thread): floats in the
    compute dtype, quantized weights as a triplet with their bits and group size; fused
    experts as their two halves."""
    for part in split_gate_up(item):
        _store(out, part, plan)


def _store(out: ConvertedWeights, item: Decoded, plan: Plan) -> None:
    module = item.name[: -len(".weight")]
    precision, dtype = plan.precision, plan.dtype
    if item.affine is not None:
        a = item.affine
        weight, scales, biases = mx.array(a.weight), mx.array(a.scales), mx.array(a.biases)
        bits, group = a.bits, a.group_size
        # the CPU: float16; elsewhere the compute dtype (quantized matmuls return the
        # scales' dtype)
        stored = precision.scales_dtype(dtype)
        scales, biases = scales.astype(stored), biases.astype(stored)
    elif item.values is not None and item.requantize_bits is not None:
        bits, group = item.requantize_bits, item.group_size
        weight, scales, biases = requantized(
            item.values, group, bits, precision.requantized_scales_dtype(dtype)
        )
    elif item.values is not None:
        array = mx.array(item.values)
        keep = item.name.endswith(FLOAT32_SUFFIX) or array.dtype == dtype
        out.weights[item.name] = array if keep else array.astype(dtype)
        out.dequantized_experts += item.dequantized_expert
        return
    else:
        raise AssertionError(f"nothing decoded for {item.name}")
    out.weights[item.name] = weight
    out.weights[f"{module}.scales"] = scales
    out.weights[f"{module}.biases"] = biases
    out.quantization[module] = {"bits": bits, "group_size": group}
