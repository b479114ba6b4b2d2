"""Compiled CPU kernels for MLX's CPU backend: kernels.c through ctypes (bridge.py), and
the quantized products as MLX primitives (ext/, primitives.py). A ctypes kernel returns
None when it does not apply or is not built, and the caller runs its MLX-ops path;
`qmatmul` and `dequantize` choose between the primitive and MLX's op themselves.
Callers use the package as a namespace:
``from runtime import kernels as cpu_kernels; cpu_kernels.attention(...)``."""

from __future__ import annotations

from runtime.kernels.bridge import (
    ENV_ISA,
    ENV_SWITCH,
    ENV_THREADS,
    MIN_ROWS,
    Kernels,
    attention,
    gated_mul,
    gemm_rows,
    kernels,
    linear,
    quantized_attention,
    thread_count,
)
from runtime.kernels.primitives import (
    SMALL_ROWS,
    dequantize,
    expected,
    extension,
    qmatmul,
    quantized_ready,
)

__all__ = [
    "ENV_ISA",
    "ENV_SWITCH",
    "ENV_THREADS",
    "MIN_ROWS",
    "SMALL_ROWS",
    "Kernels",
    "attention",
    "dequantize",
    "expected",
    "extension",
    "gated_mul",
    "gemm_rows",
    "kernels",
    "linear",
    "qmatmul",
    "quantized_attention",
    "quantized_ready",
    "thread_count",
]
