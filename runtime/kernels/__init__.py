"""Compiled CPU kernels for MLX's CPU backend (kernels.c) and their one Python bridge
(bridge.py). Each call returns None when the kernels do not apply or are not built: the
caller then runs its MLX-ops path. Callers use the package as a namespace:
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
    quantized_matmul,
)

__all__ = [
    "ENV_ISA",
    "ENV_SWITCH",
    "ENV_THREADS",
    "MIN_ROWS",
    "Kernels",
    "attention",
    "gated_mul",
    "gemm_rows",
    "kernels",
    "linear",
    "quantized_matmul",
]
