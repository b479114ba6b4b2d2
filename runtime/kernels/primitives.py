"""The MLX extension's bridge: a decode step's pieces as MLX primitives on the CPU.

`runtime/kernels/ext` (C++, built by setup.py with CMake against the pinned MLX and
nanobind) registers the C kernels as MLX primitives, so a model's decode step stays one
lazy graph: no evaluation per layer, `mx.async_eval` pipelining as with any other op.
They are the quantized products (`qmatmul`, and `qmatmuls`: several weights of one input,
optionally a gated pair with its activation), attention (`attend`), RMSNorm and RoPE. MLX's
own CPU quantized matmul is a scalar loop on one thread (0.3-1.3 tokens/s for a 0.5B model
here), and its CPU `fast.rms_norm` and `fast.rope` are graphs of many element-wise ops;
with these, quantized weights are the fast path on the CPU, and stay 4 or 8 bits in memory.

`qmatmul` is what every quantized layer calls on every backend: on the CPU with the
extension loaded, the primitive; elsewhere (Metal, CUDA, or no extension) MLX's
`mx.quantized_matmul`. `quantized_ready()` says whether quantized weights are worth
keeping (the loader's precision policy): everywhere but on a CPU without the extension.

The extension is compiled against one MLX version's C++ classes; it is used only with
that version (checked at load), and a missing or mismatched build is said once, in one
line, with the fix.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import platform
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import mlx.core as mx

from runtime.kernels import lanes
from runtime.kernels.bridge import ENV_ISA, enabled, env, thread_count

log = logging.getLogger(__name__)

# Up to this many rows (decode steps: one per running sequence, and speculative
# verify rows) read each packed weight once for all rows; more dequantize a tile of
# weights at a time into the BLAS (prompt chunks).
SMALL_ROWS = 16
# The most queries per sequence the decode attention kernel takes (decode_attention.c,
# kernels.h MLXGW_DECODE_MAX_LENGTH): a sliding window is honoured up to there.
DECODE_MAX_LENGTH = 16
# What decode rows are rounded to before they meet the weights (runtime/kernels/qdot.c):
# "int16" (the default: per block of 32, an error 256 times below llama.cpp's int8 rows),
# "int8" (llama.cpp's choice: fastest, and greedy output drifts from the float path's
# sooner), or "float32" (the float kernel, quantized.c)
ENV_ACTIVATIONS = "MLX_GATEWAY_CPU_ACTIVATIONS"
# "0" runs a decoder layer's step as its separate primitives (runtime/models/fused_layer.py)
ENV_LAYER = "MLX_GATEWAY_CPU_LAYER"
# "0" keeps quantized weights in mx.quantize's layout on the CPU (`lanes_ready`)
ENV_LANES = "MLX_GATEWAY_CPU_LANES"
ACTIVATIONS = {"int16": 16, "int8": 8, "float32": 0}
_MODULE = "runtime.kernels._mlx_ext"


def expected() -> bool:
    """Whether this platform should have the extension (x86-64 and aarch64 Linux)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


@functools.cache
def extension() -> ModuleType | None:
    """The loaded extension, or None (said once, with the reason and the fix)."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError as exc:
        if expected():
            log.warning(
                "MLX extension not loaded (%s): quantized models run dequantized to float32 "
                "on the CPU. Fix: reinstall with a C++ compiler and CMake (pip install -e .).",
                exc,
            )
        return None
    built, installed = str(getattr(module, "mlx_version", "?")), mlx_version()
    if built != installed:
        log.warning(
            "MLX extension built for mlx %s but mlx %s is installed: not used (quantized "
            "models run dequantized on the CPU). Fix: reinstall (pip install -e .).",
            built,
            installed,
        )
        return None
    return module


def mlx_version() -> str:
    """The installed MLX's version (what the extension must have been built against)."""
    return importlib.metadata.version("mlx")


def _generic() -> bool:
    """Read per call: tests switch between the AVX2 and the portable code."""
    return env(ENV_ISA) == "generic"


def activation_bits() -> int:
    """MLX_GATEWAY_CPU_ACTIVATIONS as the kernel's x_bits (an unknown value: int16, said)."""
    value = env(ENV_ACTIVATIONS, "int16")
    if value not in ACTIVATIONS:
        log.warning("%s=%r: use int16, int8 or float32; using int16", ENV_ACTIVATIONS, value)
        return ACTIVATIONS["int16"]
    return ACTIVATIONS[value]


def on_cpu() -> bool:
    return bool(mx.default_device() == mx.cpu)


def _active() -> ModuleType | None:
    if not on_cpu() or not enabled():
        return None
    return extension()


class Switches(NamedTuple):
    """What every primitive call reads from the device and the environment."""

    ext: ModuleType | None  # the extension when its kernels should run (`active`)
    threads: int
    generic: bool
    x_bits: int
    layer: bool  # a decoder layer's step as one primitive (runtime/models/fused_layer.py)


def _read_switches() -> Switches:
    layer = env(ENV_LAYER, "1") not in ("0", "false", "no", "off")
    return Switches(_active(), thread_count(), _generic(), activation_bits(), layer)


_held = threading.local()


@contextmanager
def steady() -> Iterator[None]:
    """Within it, the switches are read once on this thread: a forward's few hundred
    primitive calls then share one reading (the environment is read per call otherwise,
    because tests change it between calls; nothing changes it inside a forward)."""
    if getattr(_held, "switches", None) is not None:
        yield
        return
    _held.switches = _read_switches()
    try:
        yield
    finally:
        _held.switches = None


def switches() -> Switches:
    held: Switches | None = getattr(_held, "switches", None)
    return held if held is not None else _read_switches()


def active() -> ModuleType | None:
    """The extension when its kernels should run: on the CPU, enabled, loaded."""
    held: Switches | None = getattr(_held, "switches", None)
    return held.ext if held is not None else _active()


def lanes_ready() -> bool:
    """Whether 4- and 8-bit weights should be kept in 16-feature lanes
    (runtime/kernels/lanes.py): the primitives run here, the CPU has a lanes kernel,
    and decode rows are rounded to int16 (the kernel's activations)."""
    ext = active()
    return (
        ext is not None
        and env(ENV_LANES, "1") not in ("0", "false", "no", "off")
        and bool(ext.lanes_usable())
        and activation_bits() == 16
    )


def quantized_ready() -> bool:
    """Whether quantized weights have a fast matmul here (the loader keeps them then)."""
    return not on_cpu() or active() is not None


def qmatmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
    transpose: bool = True,
) -> mx.array:
    """x @ dequantize(w).T (``transpose``) for an affine-quantized weight: the CPU
    primitive where it applies (float32 out), else `mx.quantized_matmul`. Affine
    without `biases`: symmetric groups (`symmetric_biases`)."""
    sw = switches()
    ext = sw.ext if transpose and mode == "affine" else None
    if ext is not None and x.ndim >= 1 and (w.ndim == 2 or lanes.in_lanes(w)):
        out: mx.array = ext.quantized_matmul(
            x,
            w,
            scales,
            biases,
            group_size=group_size,
            bits=bits,
            threads=sw.threads,
            generic=sw.generic,
            small_rows=SMALL_ROWS,
            x_bits=sw.x_bits,
        )
        return out
    if lanes.in_lanes(w):  # the primitive is off now: MLX's op reads the standard layout
        w, scales, biases = lanes.to_standard(w, scales, biases, bits)
    if biases is None and mode == "affine":
        biases = symmetric_biases(scales, bits)
    return mx.quantized_matmul(
        x,
        w,
        scales=scales,
        biases=biases,
        transpose=transpose,
        group_size=group_size,
        bits=bits,
        mode=mode,
    )


def symmetric_biases(scales: mx.array, bits: int) -> mx.array:
    """The biases of symmetric groups, which a weight kept without them implies: value =
    scale * (q - 2^(bits - 1)), GGUF's Q4_0, Q5_0 and Q8_0 (runtime/models/linear.py
    `drop_symmetric_biases`). Exact: a power of two times each scale."""
    return scales * -(2 ** (bits - 1))


@dataclass(frozen=True)
class Packed:
    """One affine-quantized weight as `qmatmuls` takes it (a quantized linear layer's
    arrays): x @ dequantize(w).T + bias; no `biases`: symmetric groups."""

    w: mx.array
    scales: mx.array
    biases: mx.array | None
    bias: mx.array | None
    group_size: int
    bits: int


# what `qmatmuls` can apply between a gated pair (the C kernel's activations)
GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def qmatmuls(x: mx.array, weights: Sequence[Packed], activation: str = "") -> list[mx.array] | None:
    """Several products of one x as one CPU primitive (one pass over the threads, x
    rounded once): a layer's q, k and v, or with `activation` ("silu", "gelu_tanh") a
    gated pair's act(x @ W0.T) * (x @ W1.T) as one output. None where the primitive does
    not run (not the CPU, no extension): the caller multiplies one weight at a time."""
    sw = switches()
    ext = sw.ext
    if ext is None or x.ndim < 1 or not 1 <= len(weights) <= 8:
        return None
    outs: list[mx.array] = ext.quantized_matmuls(
        x,
        [p.w for p in weights],
        [p.scales for p in weights],
        [p.biases for p in weights],
        [p.bias for p in weights],
        group_size=[p.group_size for p in weights],
        bits=[p.bits for p in weights],
        activation=activation,
        threads=sw.threads,
        generic=sw.generic,
        small_rows=SMALL_ROWS,
        x_bits=sw.x_bits,
    )
    return outs


# the widest head the C attention kernel takes
MAX_HEAD_DIM = 512


def can_attend(q: mx.array, k: mx.array) -> bool:
    """Whether `attend` runs for these queries and keys (heads and width it takes, and
    the primitive loaded)."""
    return (
        active() is not None
        and q.ndim == 4
        and k.ndim == 4
        and q.shape[-1] <= MAX_HEAD_DIM
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
    )


def attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool,
    starts: Sequence[int] | None = None,
    window: int | None = None,
) -> mx.array | None:
    """(B, Hq, L, D) queries over (B, Hkv, K, D) keys and values (the queries being the
    last L positions; `causal` hides each query's future; `starts`: each batch row's
    first key, its left padding skipped; `window`: a sliding window, each query seeing
    its last `window` keys) as a CPU primitive: (B, Hq, L, D) in q's dtype. None where
    it does not run (not the CPU, no extension, a head over 512 wide, a window over more
    than DECODE_MAX_LENGTH queries or not causal)."""
    sw = switches()
    ext = sw.ext
    if ext is None or not can_attend(q, k) or v.shape != k.shape:
        return None
    if window is not None and (not causal or q.shape[2] > DECODE_MAX_LENGTH):
        return None
    first = None if starts is None else mx.array(list(starts), dtype=mx.int32)
    out: mx.array = ext.attention(
        q, k, v, first, scale=scale, causal=causal, threads=sw.threads, generic=sw.generic,
        window=window or 0,
    )  # fmt: skip
    # (B, L, Hq, D) memory seen as (B, Hq, L, D): the caller's transpose back is free
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def rows_ready() -> bool:
    """Whether `append_rows` and `attend_rows` run here (the CPU, the extension loaded)."""
    return active() is not None


def append_rows(
    news: Sequence[mx.array], rows: Sequence[Sequence[mx.array]], ends: Sequence[int]
) -> list[list[mx.array]] | None:
    """A running batch's rows in buffers of their own (runtime/cache/rows.py): `news[p]`
    (B, H, L, X) written into every row's buffer `rows[p][b]` (1, H, C, X) at columns
    [ends[b] - L, ends[b]), in place, as one primitive; the buffers written (the same
    memory). None where it does not run (not the CPU, no extension)."""
    ext = active()
    if ext is None or any(r and r[0].dtype != n.dtype for n, r in zip(news, rows, strict=True)):
        return None
    out: list[list[mx.array]] = ext.append_rows(list(news), [list(r) for r in rows], list(ends))
    return out


def attend_rows(
    q: mx.array,
    keys: Sequence[mx.array],
    values: Sequence[mx.array],
    lengths: Sequence[int],
    *,
    scale: float,
) -> mx.array | None:
    """`attend` (causal) of (B, Hq, L, D) queries over rows of their own: row b's keys and
    values are the first lengths[b] columns of keys[b] and values[b] (1, Hkv, C, D), its
    queries its last L positions. The same bits as `attend` over the rows left-padded in
    one buffer. None where it does not run."""
    sw = switches()
    ext = sw.ext
    if ext is None or not keys or not can_attend(q, keys[0]):
        return None
    out: mx.array = ext.attention_rows(
        q, list(keys), list(values), list(lengths), scale=scale, causal=True,
        threads=sw.threads, generic=sw.generic,
    )  # fmt: skip
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def quantized_attention_rows(
    q: mx.array,
    rows: Sequence[tuple[Sequence[mx.array], Sequence[mx.array]]],
    lengths: Sequence[int],
    *,
    bits: int,
    group_size: int,
    scale: float,
) -> mx.array | None:
    """`attend_rows` over a quantized cache's rows (runtime/cache/quantized.py): row b's
    keys and values are (codes, scales, biases) whose first lengths[b] columns it holds;
    the kernel dequantizes a key block at a time, a row at a time (each row on its own:
    the bits of the rows left-padded). None where it does not run."""
    sw = switches()
    ext = sw.ext
    if ext is None or q.ndim != 4 or q.shape[-1] > MAX_HEAD_DIM or bits not in (4, 8):
        return None
    if group_size % 8 or q.shape[-1] % group_size:
        return None
    out: mx.array = ext.quantized_attention_rows(
        q, [list(k) for k, _ in rows], [list(v) for _, v in rows], list(lengths), bits=bits,
        group_size=group_size, scale=scale, causal=True, threads=sw.threads,
        generic=sw.generic,
    )  # fmt: skip
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def gelu_erf(x: mx.array) -> mx.array | None:
    """The exact (erf) GELU of float32 `x` as one CPU primitive, or None where it does not
    run (the ctypes kernel or MLX's ops then: runtime/kernels/gelu.py)."""
    sw = switches()
    ext = sw.ext
    if ext is None or x.dtype != mx.float32 or not hasattr(ext, "gelu_erf"):
        return None
    out: mx.array = ext.gelu_erf(x, threads=sw.threads, generic=sw.generic)
    return out


def rms_norm(x: mx.array, w: mx.array, eps: float, unit_offset: bool = False) -> mx.array | None:
    """RMSNorm over the last axis as one CPU primitive, scaled by (w + 1) with
    `unit_offset` (gemma's weights); None where it does not run: MLX's op then (on the
    CPU, mx.fast.rms_norm is a graph of 6 element-wise ops)."""
    ext = active()
    if ext is None or x.ndim < 1 or w.shape != (x.shape[-1],):
        return None
    out: mx.array = ext.rms_norm(x, w, eps=eps, unit_offset=unit_offset)
    return out.astype(x.dtype)


def rope(
    x: mx.array,
    *,
    dims: int,
    inv_freq: mx.array,
    offset: int | mx.array,
    scale: float,
    mscale: float = 1.0,
) -> mx.array | None:
    """mx.fast.rope's non-traditional rotation of (B, H, L, D) `x` at `offset` (an int, or
    one per batch row) by (offset + l) * scale * inv_freq, times `mscale`, as one CPU
    primitive; None where it does not run (mx.fast.rope is about 15 ops on the CPU)."""
    ext = active()
    if ext is None or x.ndim != 4 or dims % 2 or not 0 < dims <= min(x.shape[-1], 1024):
        return None
    if isinstance(offset, mx.array):
        offsets = offset.reshape(-1)
        if offsets.size not in (1, x.shape[0]):
            return None
    else:
        offsets = mx.array([offset], dtype=mx.int32)
    out: mx.array = ext.rope(x, inv_freq, offsets, dims=dims, scale=scale, mscale=mscale)
    return out.astype(x.dtype)


def dequantize(
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """The float weight of a quantized triplet: the CPU primitive (float32, threaded)
    where it applies, else `mx.dequantize` (affine without biases: symmetric groups)."""
    sw = switches()
    ext = sw.ext if mode == "affine" and (w.ndim == 2 or lanes.in_lanes(w)) else None
    if ext is not None:
        out: mx.array = ext.dequantize(
            w, scales, biases, group_size=group_size, bits=bits, threads=sw.threads,
            generic=sw.generic,
        )  # fmt: skip
        return out
    if lanes.in_lanes(w):
        w, scales, biases = lanes.to_standard(w, scales, biases, bits)
    if biases is None and mode == "affine":
        biases = symmetric_biases(scales, bits)
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
