"""Decoding one GGUF tensor into what an MLX model loads: float arrays, or the affine
(weight, scales, biases) triplet of a weight that stays quantized (runtime/load/gguf/names.py
chooses the names and transforms, and runs this over every tensor)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

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


def float_tensor(gf: GGUFFile, info: TensorInfo, tf: Transform) -> np.ndarray:
    """The tensor as float32, with ``tf`` undone."""
    values = dequantize(gf.raw(info.name), info.ggml_type, info.shape)
    if tf.rows is not None:
        values = values[tf.rows]
    if tf.minus_one:
        values = values - np.float32(1.0)
    return values


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
    return len(info.shape) == 2 or (len(info.shape) == 3 and ".switch_mlp." in name)


@dataclass(frozen=True)
class Decoded:
    """One tensor decoded in numpy (worker threads); MLX arrays are made on the caller's
    thread, since MLX streams are per thread."""

    name: str
    values: np.ndarray | None = None  # float32
    affine: Affine | None = None
    requantize_bits: int | None = None  # quantize ``values`` to this many bits


def decode_tensor(
    gf: GGUFFile, info: TensorInfo, name: str, tf: Transform, quantized: bool
) -> Decoded:
    """``info``'s values under HF ``name``, transformed; with ``quantized``, as an MLX
    affine form where the weight can stay quantized (runs on worker threads)."""
    if quantized and keep_quantized(info, name):
        affine = to_affine(gf.raw(info.name), info.ggml_type)
        if affine is not None:
            return Decoded(name, affine=affine if tf.rows is None else affine.take_rows(tf.rows))
        # No exact affine form (Q6_K, Q2_K, IQ*): dequantize, re-quantize finely.
        bits = requantize_bits(info.ggml_type)
        return Decoded(name, values=float_tensor(gf, info, tf), requantize_bits=bits)
    return Decoded(name, values=float_tensor(gf, info, tf))


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
            Decoded(name, affine=Affine(weights[i], scales[i], biases[i], a.bits, a.group_size))
            for i, name in enumerate(names)
        ]
    assert item.values is not None
    values = np.split(item.values, 2, axis=1)
    return [
        Decoded(name, values=v, requantize_bits=item.requantize_bits)
        for name, v in zip(names, values, strict=True)
    ]


def store(out: ConvertedWeights, item: Decoded, dtype: mx.Dtype) -> None:
    """Add ``item`` to ``out`` as MLX arrays (on the caller's thread): floats in
    ``dtype``, quantized weights as a triplet with their bits and group size; fused
    experts as their two halves."""
    for part in split_gate_up(item):
        _store(out, part, dtype)


def _store(out: ConvertedWeights, item: Decoded, dtype: mx.Dtype) -> None:
    module = item.name[: -len(".weight")]
    if item.affine is not None:
        a = item.affine
        weight, scales, biases = mx.array(a.weight), mx.array(a.scales), mx.array(a.biases)
        bits, group = a.bits, a.group_size
    elif item.values is not None and item.requantize_bits is not None:
        bits, group = item.requantize_bits, GROUP
        weight, scales, biases = mx.quantize(mx.array(item.values), group_size=group, bits=bits)
    elif item.values is not None:
        array = mx.array(item.values)
        keep = item.name.endswith(FLOAT32_SUFFIX) or array.dtype == dtype
        out.weights[item.name] = array if keep else array.astype(dtype)
        return
    else:
        raise AssertionError(f"nothing decoded for {item.name}")
    out.weights[item.name] = weight
    # scales/biases in the compute dtype: quantized matmuls return the scales' dtype
    out.weights[f"{module}.scales"] = scales.astype(dtype)
    out.weights[f"{module}.biases"] = biases.astype(dtype)
    out.quantization[module] = {"bits": bits, "group_size": group}
