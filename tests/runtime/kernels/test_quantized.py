"""The quantized decode kernel (runtime/kernels/quantized.c) against dequantize-then-matmul.

The oracle is MLX's own format: `mx.quantize` packs a random float32 weight, and
`mx.dequantize` of the same arrays, multiplied in float64, is the exact product the
kernel approximates in float32. The error is measured against |x| @ |W|.T, the size of
the terms summed, so it is a float32 rounding bound and not a cancellation artefact.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime.kernels import bridge as cpu_kernels

RTOL = 1e-5
ROWS = (1, 2, 3, 7, 8, 16, 17)
SHAPES = ((67, 128), (129, 384))  # (out_features, in_features): odd N, K a group multiple
THREADS = (1, 2, 3)


@pytest.fixture
def built() -> cpu_kernels.Kernels:
    """The loaded kernels; a missing build skips locally and fails under CI."""
    loaded = cpu_kernels.load()
    if loaded is None:
        reason = "the CPU kernels are not built (pip install -e . builds them)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return loaded


def _packed(cols: int, depth: int, bits: int, group_size: int, seed: int) -> tuple[Any, ...]:
    """(w, scales, biases) as numpy arrays and the dequantized weight in float64."""
    rng = np.random.default_rng(seed)
    weight = mx.array(rng.standard_normal((cols, depth), dtype=np.float32))
    packed = mx.quantize(weight, group_size=group_size, bits=bits)
    dense = mx.dequantize(*packed, group_size=group_size, bits=bits)
    mx.eval(dense, *packed)
    w, scales, biases = (np.asarray(a) for a in packed)
    return w, scales, biases, np.asarray(dense).astype(np.float64)


def _relative_error(got: np.ndarray[Any, Any], x: np.ndarray[Any, Any], dense: Any) -> float:
    x64 = x.astype(np.float64)
    scale = np.abs(x64) @ np.abs(dense).T + 1e-30
    return float((np.abs(got - x64 @ dense.T) / scale).max())


@pytest.mark.parametrize("isa", ["avx2", "generic"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_dequantize_then_matmul(
    bits: int, group_size: int, isa: str, built: cpu_kernels.Kernels
) -> None:
    generic = isa == "generic"
    if not generic and built.lib.mlxgw_isa(0) != b"avx2-fma":
        pytest.skip("this CPU has no AVX2+FMA")
    rng = np.random.default_rng(bits * 1000 + group_size)
    threads = itertools.cycle(THREADS)
    for seed, (cols, depth) in enumerate(SHAPES):
        w, scales, biases, dense = _packed(cols, depth, bits, group_size, seed)
        for rows in ROWS:
            x = rng.standard_normal((rows, depth), dtype=np.float32)
            count = next(threads)
            got = cpu_kernels.quantized_matmul(
                x, w, scales, biases, bits=bits, group_size=group_size, threads=count,
                generic=generic,
            )  # fmt: skip
            assert got is not None and got.shape == (rows, cols) and got.dtype == np.float32
            error = _relative_error(got, x, dense)
            assert error <= RTOL, (rows, cols, depth, count, error)


def test_thread_count_does_not_change_results(built: cpu_kernels.Kernels) -> None:
    """Each output is summed in the same order whichever thread computes it."""
    w, scales, biases, _ = _packed(129, 384, 4, 64, seed=3)
    x = np.random.default_rng(3).standard_normal((5, 384), dtype=np.float32)
    outs = [
        cpu_kernels.quantized_matmul(x, w, scales, biases, bits=4, group_size=64, threads=t)
        for t in (1, 2, 3, 64)
    ]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_leading_axes_are_kept(built: cpu_kernels.Kernels) -> None:
    w, scales, biases, dense = _packed(67, 128, 8, 32, seed=4)
    x = np.random.default_rng(4).standard_normal((2, 3, 128), dtype=np.float32)
    got = cpu_kernels.quantized_matmul(x, w, scales, biases, bits=8, group_size=32)
    assert got is not None and got.shape == (2, 3, 67)
    assert _relative_error(got.reshape(6, 67), x.reshape(6, 128), dense) <= RTOL


@pytest.mark.parametrize(("bits", "group_size"), [(3, 64), (4, 16), (2, 32), (8, 256)])
def test_unsupported_formats_are_refused(
    bits: int, group_size: int, built: cpu_kernels.Kernels
) -> None:
    depth, cols = 256, 8
    x = np.zeros((1, depth), dtype=np.float32)
    w = np.zeros((cols, depth * bits // 32), dtype=np.uint32)
    groups = np.zeros((cols, depth // group_size), dtype=np.float32)
    out = np.empty((1, cols), dtype=np.float32)
    status = built.lib.mlxgw_quantized_matmul(
        x.ctypes.data, w.ctypes.data, groups.ctypes.data, groups.ctypes.data, out.ctypes.data,
        1, depth, cols, bits, group_size, 1, 0,
    )  # fmt: skip
    assert status == 1
    with pytest.raises(ValueError, match="no quantized kernel"):
        cpu_kernels.quantized_matmul(x, w, groups, groups, bits=bits, group_size=group_size)


def test_shapes_that_do_not_match_are_refused(built: cpu_kernels.Kernels) -> None:
    w, scales, biases, _ = _packed(8, 128, 4, 64, seed=5)
    with pytest.raises(ValueError, match="shapes"):  # K not the weight's
        cpu_kernels.quantized_matmul(
            np.zeros((1, 96), dtype=np.float32), w, scales, biases, bits=4, group_size=64
        )
    with pytest.raises(ValueError, match="shapes"):  # the packing of another bit width
        cpu_kernels.quantized_matmul(
            np.zeros((1, 128), dtype=np.float32), w, scales, biases, bits=8, group_size=64
        )
    # the C side refuses a depth that is not a whole number of groups on its own too
    out = np.empty((1, 8), dtype=np.float32)
    x = np.zeros((1, 96), dtype=np.float32)
    status = built.lib.mlxgw_quantized_matmul(
        x.ctypes.data, w.ctypes.data, scales.ctypes.data, biases.ctypes.data, out.ctypes.data,
        1, 96, 8, 4, 64, 1, 0,
    )  # fmt: skip
    assert status == 1


def test_missing_library_returns_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    w, scales, biases, _ = _packed(8, 64, 4, 64, seed=6)
    x = np.zeros((1, 64), dtype=np.float32)
    assert cpu_kernels.quantized_matmul(x, w, scales, biases, bits=4, group_size=64) is None


def test_the_library_declares_the_argument_types(built: cpu_kernels.Kernels) -> None:
    """ctypes passes 64-bit sizes only where argtypes say so."""
    argtypes = built.lib.mlxgw_quantized_matmul.argtypes
    assert argtypes[5:8] == [ctypes.c_int64] * 3 and len(argtypes) == 12
