"""The MLX extension's bridge: quantized products as MLX primitives on the CPU.

`runtime/kernels/ext` (C++, built by setup.py with CMake against the pinned MLX and
nanobind) registers `runtime/kernels/quantized.c` as MLX primitives, so a quantized
model's decode step stays one lazy graph: no evaluation per layer, `mx.async_eval`
pipelining as with any other op. MLX's own CPU quantized matmul is a scalar loop on one
thread (0.3-1.3 tokens/s for a 0.5B model here); with these, quantized weights are the
fast path on the CPU, and stay 4 or 8 bits in memory.

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
import os
import platform
import sys
from types import ModuleType

import mlx.core as mx

from runtime.kernels.bridge import ENV_ISA, enabled, thread_count

log = logging.getLogger(__name__)

# Up to this many rows (decode steps: one per running sequence, and speculative
# verify rows) read each packed weight once for all rows; more dequantize a tile of
# weights at a time into the BLAS (prompt chunks).
SMALL_ROWS = 16
# What decode rows are rounded to before they meet the weights (runtime/kernels/qdot.c):
# "int16" (the default: per block of 32, an error 256 times below llama.cpp's int8 rows),
# "int8" (llama.cpp's choice: fastest, and greedy output drifts from the float path's
# sooner), or "float32" (the float kernel, quantized.c)
ENV_ACTIVATIONS = "MLX_GATEWAY_CPU_ACTIVATIONS"
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
    return os.environ.get(ENV_ISA, "").strip().lower() == "generic"


def activation_bits() -> int:
    """MLX_GATEWAY_CPU_ACTIVATIONS as the kernel's x_bits (an unknown value: int16, said)."""
    value = os.environ.get(ENV_ACTIVATIONS, "int16").strip().lower()
    if value not in ACTIVATIONS:
        log.warning("%s=%r: use int16, int8 or float32; using int16", ENV_ACTIVATIONS, value)
        return ACTIVATIONS["int16"]
    return ACTIVATIONS[value]


def on_cpu() -> bool:
    return bool(mx.default_device() == mx.cpu)


def active() -> ModuleType | None:
    """The extension when its kernels should run: on the CPU, enabled, loaded."""
    if not on_cpu() or not enabled():
        return None
    return extension()


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
    primitive where it applies (float32 out), else `mx.quantized_matmul`."""
    ext = active() if transpose and mode == "affine" and biases is not None else None
    if ext is not None and x.ndim >= 1 and w.ndim == 2:
        out: mx.array = ext.quantized_matmul(
            x,
            w,
            scales,
            biases,
            group_size=group_size,
            bits=bits,
            threads=thread_count(),
            generic=_generic(),
            small_rows=SMALL_ROWS,
            x_bits=activation_bits(),
        )
        return out
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
    where it applies, else `mx.dequantize`."""
    ext = active() if mode == "affine" and biases is not None and w.ndim == 2 else None
    if ext is not None:
        out: mx.array = ext.dequantize(
            w, scales, biases, group_size=group_size, bits=bits, threads=thread_count(),
            generic=_generic(),
        )  # fmt: skip
        return out
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
