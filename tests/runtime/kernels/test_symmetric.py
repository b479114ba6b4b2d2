"""Symmetric groups kept without biases (MLXGW_SYMMETRIC): GGUF's Q4_0, Q5_0 and Q8_0 on
the CPU, whose every bias is -2^(bits - 1) times its scale.

The oracle is the same weight with its biases stored: every path (the int16, int8 and
float decode kernels on AVX-512, AVX2 and the portable code; the prompt-sized tiles
through the BLAS; dequantization; MLX's ops where the primitives do not run) must give
the same bits without them, since the bias it computes is the one that was stored.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime import kernels
from runtime.kernels import primitives
from runtime.models.linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    drop_symmetric_biases,
    fused_products,
)

ROWS = (1, 3, 17)  # decode kernels, and (17 > SMALL_ROWS) tiles through the BLAS
PATHS = [  # (MLX_GATEWAY_CPU_ISA, MLX_GATEWAY_CPU_ACTIVATIONS)
    ("", "int16"),
    ("avx2", "int16"),
    ("avx2", "int8"),
    ("", "float32"),
    ("generic", "int16"),
]


def _symmetric(
    cols: int, depth: int, bits: int, seed: int, group_size: int = 32
) -> tuple[mx.array, mx.array, mx.array]:
    """(w, scales, biases) with float16 scales and biases = -2^(bits - 1) * scales."""
    rng = np.random.default_rng(seed)
    weight = mx.array(rng.standard_normal((cols, depth), dtype=np.float32))
    w, scales, _ = mx.quantize(weight, group_size=group_size, bits=bits)
    scales = scales.astype(mx.float16)
    biases = kernels.symmetric_biases(scales, bits)
    mx.eval(w, scales, biases)
    return w, scales, biases


@pytest.mark.parametrize(("isa", "activations"), PATHS)
@pytest.mark.parametrize("bits", (2, 3, 4, 5, 6, 8))
def test_every_path_gives_the_bits_of_the_stored_biases(
    ext: Any, monkeypatch: pytest.MonkeyPatch, isa: str, activations: str, bits: int
) -> None:
    if isa:
        monkeypatch.setenv(kernels.ENV_ISA, isa)
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, activations)
    w, scales, biases = _symmetric(67, 256, bits, seed=bits)
    rng = np.random.default_rng(7)
    for rows in ROWS:
        x = mx.array(rng.standard_normal((rows, 256), dtype=np.float32))
        kw: dict[str, Any] = {"group_size": 32, "bits": bits}
        stored = kernels.qmatmul(x, w, scales, biases, **kw)
        implied = kernels.qmatmul(x, w, scales, None, **kw)
        assert implied.shape == (rows, 67)
        assert mx.array_equal(stored, implied).item(), (rows, bits, isa, activations)


@pytest.mark.parametrize("group_size", (32, 64, 128))
def test_dequantize_and_group_sizes(ext: Any, group_size: int) -> None:
    for bits in (4, 5, 8):
        w, scales, biases = _symmetric(33, 256, bits, seed=bits, group_size=group_size)
        kw: dict[str, Any] = {"group_size": group_size, "bits": bits}
        want = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), **kw)
        assert mx.array_equal(kernels.dequantize(w, scales, None, **kw), want).item()
        x = mx.array(np.random.default_rng(bits).standard_normal((2, 256), dtype=np.float32))
        assert mx.array_equal(
            kernels.qmatmul(x, w, scales, None, **kw), kernels.qmatmul(x, w, scales, biases, **kw)
        ).item()


def test_without_the_primitives_mlx_is_given_the_implied_biases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Metal, CUDA, or the kernels switched off: MLX's ops need biases, and get them."""
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    w, scales, biases = _symmetric(16, 64, 4, seed=3)
    x = mx.array(np.random.default_rng(3).standard_normal((2, 64), dtype=np.float32))
    kw: dict[str, Any] = {"group_size": 32, "bits": 4}
    want = mx.quantized_matmul(x, w, scales, biases, transpose=True, **kw)
    assert mx.array_equal(kernels.qmatmul(x, w, scales, None, **kw), want).item()
    assert mx.array_equal(
        kernels.dequantize(w, scales, None, **kw), mx.dequantize(w, scales, biases, **kw)
    ).item()


def _linear(bits: int, seed: int, symmetric: bool) -> QuantizedLinear:
    layer = QuantizedLinear(128, 40, bias=True, group_size=32, bits=bits)
    w, scales, biases = _symmetric(40, 128, bits, seed)
    if not symmetric:
        biases = biases + mx.array(0.25, dtype=mx.float16)
    layer.update({"weight": w, "scales": scales, "biases": biases})
    return layer


def test_the_loader_drops_only_biases_that_equal_the_implied_ones(ext: Any) -> None:
    class Net(QuantizedLinear):  # a module holding layers, as a model does
        pass

    sym, other = _linear(5, 1, symmetric=True), _linear(8, 2, symmetric=False)
    emb = QuantizedEmbedding(50, 128, group_size=32, bits=8)
    w, scales, biases = _symmetric(50, 128, 8, seed=4)
    emb.update({"weight": w, "scales": scales, "biases": biases})
    model = Net(32, 8, bias=False, group_size=32, bits=4)  # its own biases are not symmetric
    model.sym, model.other, model.emb = sym, other, emb
    x = mx.array(np.random.default_rng(5).standard_normal((3, 128), dtype=np.float32))
    ids = mx.array([[0, 7, 49]])
    fused = fused_products(x, (sym, other))
    assert fused is not None
    before = [sym(x), other(x), emb(ids), emb.as_linear(x), *fused]
    mx.eval(before)

    freed = drop_symmetric_biases(model)

    assert freed == sym["scales"].nbytes + emb["scales"].nbytes
    assert "biases" not in sym and "biases" not in emb and "biases" in other
    assert "biases" in model  # mx.quantize's own biases are not -8 * scale
    assert sym.biases is None and "biases" not in dict(sym.parameters())
    fused = fused_products(x, (sym, other))
    assert fused is not None
    after = [sym(x), other(x), emb(ids), emb.as_linear(x), *fused]
    for a, b in zip(before, after, strict=True):
        assert mx.array_equal(a, b).item()


def test_nothing_is_dropped_where_the_primitives_do_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    layer = _linear(4, 1, symmetric=True)
    assert drop_symmetric_biases(layer) == 0
    assert "biases" in layer
