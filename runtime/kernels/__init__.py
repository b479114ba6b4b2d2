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
    GEMM_ROWS,
    MIN_ROWS,
    Kernels,
    attention,
    gated_mul,
    kernels,
    linear,
    quantized_attention,
    thread_count,
)
from runtime.kernels.gelu import gelu_erf
from runtime.kernels.primitives import (
    DECODE_MAX_LENGTH,
    GATED_ACTIVATIONS,
    SMALL_ROWS,
    Packed,
    active,
    append_rows,
    attend,
    attend_rows,
    can_attend,
    dequantize,
    expected,
    extension,
    lanes_ready,
    qmatmul,
    qmatmuls,
    quantized_attention_rows,
    quantized_ready,
    rms_norm,
    rope,
    rows_ready,
    steady,
    switches,
    symmetric_biases,
)

__all__ = [
    "DECODE_MAX_LENGTH",
    "ENV_ISA",
    "ENV_SWITCH",
    "ENV_THREADS",
    "GATED_ACTIVATIONS",
    "GEMM_ROWS",
    "MIN_ROWS",
    "SMALL_ROWS",
    "Kernels",
    "Packed",
    "active",
    "append_rows",
    "attend",
    "attend_rows",
    "attention",
    "can_attend",
    "dequantize",
    "expected",
    "extension",
    "gated_mul",
    "gelu_erf",
    "kernels",
    "lanes_ready",
    "linear",
    "qmatmul",
    "qmatmuls",
    "quantized_attention",
    "quantized_attention_rows",
    "quantized_ready",
    "rms_norm",
    "rope",
    "rows_ready",
    "steady",
    "switches",
    "symmetric_biases",
    "thread_count",
]
