"""BERT's exact (erf) GELU on the CPU kernels' threads (kernels.c's mlxgw_gelu_erf): MLX's
erf is a scalar loop and its fused form of the rational erf runs on one thread, while the
GELU is about a quarter of an encoder's forward.

As the extension's primitive (runtime/kernels/primitives.py) it stays in the lazy graph, so
a piece's layers run as one evaluation; through ctypes (a build without the extension) it
evaluates its input, and copies it out and the result back in."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import mlx.core as mx
import numpy as np

from runtime.kernels.bridge import MIN_ROWS, kernels
from runtime.kernels.primitives import gelu_erf as primitive_gelu


@functools.cache
def _function(lib: ctypes.CDLL) -> Any:
    fn = lib.mlxgw_gelu_erf
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_int32] * 2
    fn.restype = ctypes.c_int
    return fn


def gelu_erf(x: mx.array) -> mx.array | None:
    """gelu(x) for a float32 array of at least MIN_ROWS rows, or None to use MLX instead.
    Evaluates `x` (an encoder runs its forward a layer at a time anyway)."""
    if x.dtype != mx.float32 or x.ndim == 0 or x.size < MIN_ROWS * x.shape[-1]:
        return None
    lazy = primitive_gelu(x)
    if lazy is not None:
        return lazy
    lib = kernels()
    if lib is None:
        return None
    try:
        fn = _function(lib.lib)
    except AttributeError:  # a library built before the function existed
        return None
    mx.eval(x)
    xn = np.ascontiguousarray(x)
    out = np.empty(xn.shape, dtype=np.float32)
    status = fn(xn.ctypes.data, out.ctypes.data, xn.size, lib.threads, int(lib.generic))
    return mx.array(out) if status == 0 else None
