"""GGML block formats -> MLX affine quantization (weight, scales, biases) or float32.

Every "legacy" and 4/5-bit K-quant format is an affine map per 32 values, which is
exactly MLX's affine quantization with ``group_size=32``: value = scale * q + bias.
So these convert without loss (scales/biases are exact float32 products of the fp16
block scale and the small integer sub-scales):

=========  =====  ============================================================
ggml type  bits   value
=========  =====  ============================================================
Q4_0       4      d * (q - 8)
Q4_1       4      d * q + m
Q5_0       5      d * (q - 16)
Q5_1       5      d * q + m
Q8_0       8      d * (q_signed)         (q_signed + 128 stored unsigned)
Q4_K       4      (d * sc_j) * q - dmin * m_j     (8 sub-blocks of 32)
Q5_K       5      (d * sc_j) * q - dmin * m_j
=========  =====  ============================================================

Scales and biases: the legacy types' (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are float16 values
times a power of two, so float16 holds them exactly (``FLOAT16_SCALES``; checked per tensor
all the same). The K-quants' products d * sc_j and dmin * m_j need up to 17 significant
bits: in the real Q4_K tensors here only 0.7-0.9% of the groups have both in float16.
Rounding them to float16 anyway moves Gemma-3-270M's logits by up to 0.086 (Qwen2.5-Coder-
0.5B: 0.023), far inside the 4-bit grid's own error, and greedy output agrees with
llama.cpp's exactly as long as with float32 scales (bench/greedy_agreement.py, 3 models x
4 prompts x 48 tokens: 419 tokens either way; the float32 path: 375). So on the CPU every
repack stores float16 scales and biases, which keeps a Q4_K weight at 0.625 bytes where
float32 scales made it 0.75 (a 7B Q4_K_M model: about 1.1x its file instead of 1.3x).
Bytes per weight on the CPU:

==========  ============  ==========================================
ggml type   in the file   on the CPU (weights + scales + biases)
==========  ============  ==========================================
Q4_0        0.5625        0.5625 (4-bit, float16 scales, no biases *)
Q4_1        0.625         0.625  (4-bit, float16 scales)
Q5_0        0.6875        0.6875 (5-bit, float16 scales, no biases *)
Q5_1        0.75          0.75   (5-bit, float16 scales)
Q8_0        1.0625        1.0625 (no biases *)
Q4_K        0.5625        0.625  (4-bit, float16 scales, rounded)
Q5_K        0.6875        0.75   (5-bit, float16 scales, rounded)
==========  ============  ==========================================

(*) The symmetric types' biases are -2^(bits - 1) times their scales: converted here with
biases like every other type, they are dropped once the model is loaded where the CPU
primitives run, which compute them (runtime/models/linear.py `drop_symmetric_biases`);
Metal and CUDA keep them (0.0625 bytes a weight more), as MLX's kernels need them.

Anything else (Q6_K has 16-value sub-blocks, which MLX's smallest group of 32 cannot
express; Q2_K/Q3_K/IQ*/TQ*/MXFP4 use grids or signed sub-scales) is dequantized with the
``gguf`` package's reference numpy code and, when the caller keeps weights quantized,
re-quantized (runtime/load/affine.py's min-max grid, groups of 32): to 8 bits with float16
scales on the CPU (1.125 bytes per weight), to ``requantize_bits`` elsewhere. Measured
against the exact dequantized values (max |error| / the row's max |value|, and RMS error
/ RMS value):

======================================  =====================  =======  =======
source                                  re-quantized to        max      RMS
======================================  =====================  =======  =======
Q6_K, Gemma-3-270M (9 tensors)          8 bits, float16        4.46e-3  4.81e-3
Q6_K, Qwen2.5-Coder-0.5B (12 tensors)   8 bits, float16        4.29e-3  4.76e-3
Q2_K, random blocks (no file here)      8 bits, float16        2.99e-3  2.42e-3
Q3_K, random blocks (no file here)      8 bits, float16        4.10e-3  3.99e-3
Q2_K, random blocks                     6 bits, mx.quantize    1.51e-2  1.15e-2
Q3_K, random blocks                     6 bits, mx.quantize    3.12e-2  1.29e-2
======================================  =====================  =======  =======

The 6-bit rows are the accelerators' choice (``requantize_bits``). For scale: 4 bits would give 6.7e-2 max and 8.1e-2 RMS on the same Q6_K tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as _gguf_dequantize

GROUP = 32
_CHUNK_BYTES = 1 << 16
# types whose scales and biases are float16 values (see the module docstring)
FLOAT16_SCALES = frozenset({int(QT.Q4_0), int(QT.Q4_1), int(QT.Q5_0), int(QT.Q5_1), int(QT.Q8_0)})


@dataclass(frozen=True)
class Affine:
    """An MLX affine-quantized matrix: ``weight`` uint32 (rows, cols*bits/32), ``scales``
    and ``biases`` float32 (rows, cols/group_size)."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int = GROUP

    def take_rows(self, index: np.ndarray) -> Affine:
        return Affine(
            self.weight[index], self.scales[index], self.biases[index], self.bits, self.group_size
        )


@dataclass(frozen=True)
class _Unpacked:
    """Block values as unsigned ints (n_groups, 32) with one scale/bias per group."""

    q: np.ndarray
    scales: np.ndarray  # (n_groups, 1) float32
    biases: np.ndarray
    bits: int


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of every block, as float32 (n_blocks, 1)."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value nibble layout: 16 bytes -> low nibbles are values 0..15,
    high nibbles values 16..31. qs: (n, 16) -> (n, 32)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _q5_high_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """Bit j of the little-endian u32 ``qh`` is bit 4 of value j. (n, 4) -> (n, 32)."""
    return np.unpackbits(qh_bytes, axis=-1, bitorder="little") << np.uint8(4)


def _q4_0(b: np.ndarray) -> _Unpacked:
    d = _f16(b, 0)
    return _Unpacked(_nibbles(b[:, 2:]), d, -8.0 * d, 4)


def _q4_1(b: np.ndarray) -> _Unpacked:
    return _Unpacked(_nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2), 4)


def _q5_0(b: np.ndarray) -> _Unpacked:
    d = _f16(b, 0)
    return _Unpacked(_nibbles(b[:, 6:]) | _q5_high_bits(b[:, 2:6]), d, -16.0 * d, 5)


def _q5_1(b: np.ndarray) -> _Unpacked:
    q = _nibbles(b[:, 8:]) | _q5_high_bits(b[:, 4:8])
    return _Unpacked(q, _f16(b, 0), _f16(b, 2), 5)


def _q8_0(b: np.ndarray) -> _Unpacked:
    d = _f16(b, 0)
    # int8 two's complement -> q + 128 as uint8, so the bias is -128 d.
    return _Unpacked(b[:, 2:] ^ np.uint8(0x80), d, -128.0 * d, 8)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte packed 6-bit (scale, min) pairs of Q4_K/Q5_K -> two (n, 8) arrays.

    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; bytes 8-11 hold the low
    nibbles of scales 4-7 and high nibbles of mins 4-7, whose top 2 bits sit in the
    spare top bits of bytes 0-3 / 4-7.
    """
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K value layout: 4 chunks of 32 bytes; low nibbles are sub-block 2c,
    high nibbles sub-block 2c+1. (n, 128) -> (n*8, 32)."""
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & np.uint8(0x0F)).reshape(-1, 32)


def _k_affine(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sub-block (scale, bias), (n*8, 1) each: d*sc_j and -dmin*m_j."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    return (d * sc).reshape(-1, 1), (-(dmin * mn)).reshape(-1, 1)


def _q4_k(b: np.ndarray) -> _Unpacked:
    scales, biases = _k_affine(b)
    return _Unpacked(_k_low_nibbles(b[:, 16:]), scales, biases, 4)


def _q5_k(b: np.ndarray) -> _Unpacked:
    scales, biases = _k_affine(b)
    # qh: 32 bytes; bit j of byte i is bit 4 of value i of sub-block j.
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _k_low_nibbles(b[:, 48:]) | ((qh & np.uint8(1)) << np.uint8(4)).reshape(-1, 32)
    return _Unpacked(q, scales, biases, 5)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack small unsigned integers (row-major) into a flat uint32 bit stream."""
    q = q.reshape(-1)
    if bits == 8:
        packed = q
    elif bits == 4:
        pairs = q.reshape(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << np.uint8(4))
    else:
        # Eight b-bit values make exactly b bytes: assemble them in a uint64 and keep
        # its low b bytes (little-endian), which is the bit stream MLX expects.
        octets = q.reshape(-1, 8)
        word = octets[:, 0].astype(np.uint64)
        for k in range(1, 8):
            word |= octets[:, k].astype(np.uint64) << np.uint64(bits * k)
        packed = word.view(np.uint8).reshape(-1, 8)[:, :bits].reshape(-1)
    return np.ascontiguousarray(packed).view(np.uint32)


# ggml type -> (bytes per 32/256-value block, decoder)
_LOSSLESS: dict[int, tuple[int, Callable[[np.ndarray], _Unpacked]]] = {
    int(QT.Q4_0): (18, _q4_0),
    int(QT.Q4_1): (20, _q4_1),
    int(QT.Q5_0): (22, _q5_0),
    int(QT.Q5_1): (24, _q5_1),
    int(QT.Q8_0): (34, _q8_0),
    int(QT.Q4_K): (144, _q4_k),
    int(QT.Q5_K): (176, _q5_k),
}


def _row_chunks(raw: np.ndarray) -> tuple[np.ndarray, int]:
    """Rows as a 2-D uint8 array and how many rows to convert at a time: chunks of
    about 64 KiB keep the bit twiddling's temporaries in cache (several times faster
    than whole-tensor passes on large embeddings)."""
    rows = np.ascontiguousarray(raw).reshape(-1, raw.shape[-1])
    return rows, max(1, _CHUNK_BYTES // max(1, rows.shape[1]))


_FLOAT_TYPES = frozenset({int(QT.F32), int(QT.F16), int(QT.BF16), int(QT.F64)})


def is_float(ggml_type: int) -> bool:
    return ggml_type in _FLOAT_TYPES


def to_affine(raw: np.ndarray, ggml_type: int) -> Affine | None:
    """The exact MLX affine form of a block-quantized tensor, or None when the type has
    none (see the module docstring). ``raw`` is :meth:`GGUFFile.raw`'s uint8 view."""
    entry = _LOSSLESS.get(ggml_type)
    if entry is None:
        return None
    type_size, decode = entry
    rows, step = _row_chunks(raw)
    weights, scales, biases, bits = [], [], [], 0
    for i in range(0, rows.shape[0], step):
        u = decode(rows[i : i + step].reshape(-1, type_size))
        bits = u.bits
        weights.append(_pack(u.q, bits))
        scales.append(u.scales.reshape(-1))
        biases.append(u.biases.reshape(-1))
    lead = raw.shape[:-1]
    return Affine(
        np.concatenate(weights).reshape(*lead, -1),
        np.concatenate(scales).reshape(*lead, -1),
        np.concatenate(biases).reshape(*lead, -1),
        bits,
    )


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Any GGML tensor as float32 of ``shape``; bit-identical to the gguf package's
    reference decoders (which handle the types without an affine form)."""
    if ggml_type == int(QT.BF16):
        words = np.ascontiguousarray(raw).astype(np.uint32) << np.uint32(16)
        return words.view(np.float32).reshape(shape)
    if ggml_type in _FLOAT_TYPES or raw.dtype != np.uint8:
        return np.asarray(raw, dtype=np.float32).reshape(shape)
    entry = _LOSSLESS.get(ggml_type)
    if entry is None:
        out = _gguf_dequantize(np.ascontiguousarray(raw), QT(ggml_type))
        return np.asarray(out, dtype=np.float32).reshape(shape)
    type_size, decode = entry
    rows, step = _row_chunks(raw)
    out = np.empty(int(np.prod(shape)), dtype=np.float32).reshape(rows.shape[0], -1)
    for i in range(0, rows.shape[0], step):
        u = decode(rows[i : i + step].reshape(-1, type_size))
        chunk = out[i : i + step].reshape(-1, u.q.shape[-1])
        np.multiply(u.q, u.scales, out=chunk)
        chunk += u.biases
    return out.reshape(shape)


def requantize_bits(ggml_type: int) -> int:
    """Bits for re-quantizing a type that has no exact affine form on an accelerator (the
    CPU takes 8 bits for all: runtime/load/precision.py).

    Q6_K/Q8_K and other >= 6-bit formats go to 8 bits (the extra re-quantization error is
    a fraction of the source's own step); the low-bit grids (Q2_K, Q3_K, IQ*, TQ*, MXFP4)
    go to 6 bits, since a 4-bit affine grid cannot follow their non-uniform levels.
    """
    try:
        name = QT(ggml_type).name
    except ValueError:
        return 8
    return 8 if name in {"Q6_K", "Q8_K", "Q8_1"} else 6
