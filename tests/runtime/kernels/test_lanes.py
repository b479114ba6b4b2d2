"""Weights in 16-feature lanes (runtime/kernels/lanes.py, qlanes.c).

Oracles: the layout gives back the bytes it was made from; where the lanes kernels do
not run (the portable code, int8 and float32 activations, prompt-sized tiles through the
BLAS, dequantization, MLX's ops) a weight in lanes gives the bits of the same weight in
the standard layout, since those paths read a standard copy of it or the same values;
where they run (int16 rows: qlanes.c on AVX-512 VNNI, qlanes2.c on AVX2, which
MLX_GATEWAY_CPU_ISA=avx2 picks on a CPU that has both) the result stays within the bound
that rounding x to int16 implies, a row's result does not depend on the rows beside it,
and the two kernels give the same bits.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.nn.layers.base import Module

from runtime import kernels
from runtime.kernels import lanes, primitives
from runtime.models.linear import (
    Embedding,
    QuantizedEmbedding,
    QuantizedLinear,
    fused_products,
    use_lanes,
)
from tests.runtime.kernels.test_primitives import _cpu_flags, _has_avx512

BITS = (4, 5, 6, 8)
STYPES = (mx.float32, mx.float16, mx.bfloat16)


def _weight(
    cols: int,
    depth: int,
    bits: int,
    seed: int,
    group_size: int = 32,
    stype: mx.Dtype = mx.float16,
    symmetric: bool = False,
) -> tuple[mx.array, mx.array, mx.array | None]:
    rng = np.random.default_rng(seed)
    dense = mx.array(rng.standard_normal((cols, depth), dtype=np.float32))
    w, scales, biases = mx.quantize(dense, group_size=group_size, bits=bits)
    scales = scales.astype(stype)
    kept = None if symmetric else biases.astype(stype)
    mx.eval(w, scales, kept)
    return w, scales, kept


def _x(rows: int, depth: int, seed: int = 3) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((rows, depth), dtype=np.float32))


def _qmatmul(x: mx.array, arrays: tuple[mx.array, mx.array, mx.array | None], bits: int,
             group_size: int = 32) -> np.ndarray[Any, Any]:  # fmt: skip
    w, scales, biases = arrays
    return np.array(kernels.qmatmul(x, w, scales, biases, group_size=group_size, bits=bits))


def _dense(
    arrays: tuple[mx.array, mx.array, mx.array | None], bits: int, group_size: int = 32
) -> Any:
    w, scales, biases = arrays
    if biases is None:
        biases = kernels.symmetric_biases(scales, bits)
    out = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                        group_size=group_size, bits=bits)  # fmt: skip
    return np.array(out, dtype=np.float64)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", (32, 64, 128))
@pytest.mark.parametrize("stype", STYPES)
@pytest.mark.parametrize("symmetric", (False, True))
def test_the_layout_gives_back_its_bytes(
    bits: int, group_size: int, stype: mx.Dtype, symmetric: bool
) -> None:
    w, scales, biases = _weight(48, 256, bits, seed=bits, group_size=group_size, stype=stype,
                                symmetric=symmetric)  # fmt: skip
    assert lanes.fits(w, scales, bits, group_size)
    lw, ls, lb = lanes.to_lanes(w, scales, biases, bits)
    assert lanes.in_lanes(lw) and not lanes.in_lanes(w)
    assert lw.shape == (3, 256 * bits // 32, 16) and lw.dtype == mx.int32
    assert ls.shape == (3, 256 // group_size, 16) and ls.dtype == stype
    assert (lb is None) == symmetric
    back = lanes.to_standard(lw, ls, lb, bits)
    assert back[0].dtype == mx.uint32
    assert mx.array_equal(back[0], w).item() and mx.array_equal(back[1], scales).item()
    assert symmetric or (
        back[2] is not None and biases is not None and mx.array_equal(back[2], biases).item()
    )


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(("features", "depth", "threads"), [(16, 32, 1), (48, 256, 2), (80, 96, 3)])
def test_the_c_permutation_is_numpys(
    ext: Any, bits: int, features: int, depth: int, threads: int
) -> None:
    """At load the extension permutes the bytes (qlanes.c): the same as lanes.py's numpy,
    on any number of threads, and back to the standard bytes."""
    w, scales, biases = _weight(features, depth, bits, seed=features + bits)
    want = lanes.to_lanes(w, scales, biases, bits)
    got = lanes.to_lanes(w, scales, biases, bits, ext=ext, threads=threads)
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()
    assert mx.array_equal(lanes.to_standard(*got, bits)[0], w).item()
    wrong = np.zeros(features * depth * bits // 8 + 1, dtype=np.uint8)
    with pytest.raises(ValueError, match="bytes"):
        ext.lanes_from_standard(wrong, wrong, features, depth, bits, threads)
    assert not ext.lanes_from_standard(  # a width lanes do not take
        np.zeros(features * depth * 3 // 8, np.uint8), np.zeros(features * depth * 3 // 8, np.uint8),
        features, depth, 3, threads,
    )  # fmt: skip


def test_what_does_not_fit_stays_standard() -> None:
    w, scales, _ = _weight(40, 256, 4, seed=1)  # 40 features: not whole strips
    assert not lanes.fits(w, scales, 4, 32)
    for bits in (2, 3):
        w, scales, _ = _weight(32, 256, bits, seed=bits)
        assert not lanes.fits(w, scales, bits, 32)


@pytest.mark.parametrize(("isa", "activations"), [("avx2", "int8"), ("", "int8"),
                                                  ("", "float32"), ("generic", "int16")])  # fmt: skip
@pytest.mark.parametrize("bits", BITS)
def test_paths_without_the_lanes_kernel_give_the_standard_bits(
    ext: Any, monkeypatch: pytest.MonkeyPatch, isa: str, activations: str, bits: int
) -> None:
    if isa:
        monkeypatch.setenv(kernels.ENV_ISA, isa)
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, activations)
    for symmetric in (False, True):
        arrays = _weight(64, 256, bits, seed=bits, symmetric=symmetric)
        moved = lanes.to_lanes(*arrays, bits)
        for rows in (1, 5, 17):
            x = _x(rows, 256)
            np.testing.assert_array_equal(_qmatmul(x, moved, bits), _qmatmul(x, arrays, bits))


# qlanes.c where the CPU has AVX-512 VNNI, else qlanes2.c (with AVX-VNNI where the CPU has
# it); "avxvnni" and "avx2" force the second, with and without AVX-VNNI
LANES_ISAS = ("", "avx2", "avxvnni")


def _lanes_kernel(ext: Any, monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    monkeypatch.setenv(kernels.ENV_ISA, isa)
    if not ext.lanes_usable():
        pytest.skip("this CPU has no AVX2: the lanes kernels do not run")


@pytest.mark.parametrize("isa", LANES_ISAS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", (32, 64, 128))
@pytest.mark.parametrize("stype", STYPES)
def test_the_lanes_kernel_stays_within_the_int16_rounding_bound(
    ext: Any, monkeypatch: pytest.MonkeyPatch, isa: str, bits: int, group_size: int,
    stype: mx.Dtype,
) -> None:  # fmt: skip
    _lanes_kernel(ext, monkeypatch, isa)
    for symmetric in (False, True):
        arrays = _weight(80, 384, bits, seed=bits + group_size, group_size=group_size,
                         stype=stype, symmetric=symmetric)  # fmt: skip
        moved = lanes.to_lanes(*arrays, bits)
        dense = _dense(arrays, bits, group_size)
        for rows in (1, 2, 3, 4, 5, 8, 9, 16):
            x = _x(rows, 384, seed=rows)
            xn = np.array(x, dtype=np.float64)
            exact = xn @ dense.T
            got = _qmatmul(x, moved, bits, group_size)
            # each block's x rounds to steps of max|x_block| / 32767 (qdot.c)
            blocks = np.abs(xn.reshape(rows, -1, 32)).max(axis=2) / (2 * 32767.0)
            bound = blocks @ np.abs(dense).reshape(80, -1, 32).sum(axis=2).T
            slack = 1e-5 * (np.abs(xn) @ np.abs(dense).T) + 1e-6
            assert (np.abs(got - exact) <= bound + slack).all(), (symmetric, rows)


@pytest.mark.parametrize("isa", LANES_ISAS)
@pytest.mark.parametrize("bits", BITS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(
    ext: Any, monkeypatch: pytest.MonkeyPatch, isa: str, bits: int
) -> None:
    _lanes_kernel(ext, monkeypatch, isa)
    for symmetric in (False, True):
        moved = lanes.to_lanes(*_weight(96, 320, bits, seed=7, symmetric=symmetric), bits)
        x = _x(16, 320)
        alone = [_qmatmul(x[i : i + 1], moved, bits)[0] for i in range(16)]
        for rows in range(1, 17):
            together = _qmatmul(x[:rows], moved, bits)
            for i in range(rows):
                np.testing.assert_array_equal(together[i], alone[i])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", (32, 128))
@pytest.mark.parametrize("stype", STYPES)
def test_the_avx2_lanes_kernels_give_the_avx512_bits(
    ext: Any, monkeypatch: pytest.MonkeyPatch, bits: int, group_size: int, stype: mx.Dtype
) -> None:
    """qlanes2.c does qlanes.c's arithmetic in 8-lane vectors, with or without AVX-VNNI:
    the same int32 sums per block, converted, scaled and added in the same order, so every
    row count (one pass of up to 8 rows, the two-row path, remainders), prompt tile and
    dequantized weight comes out bit for bit the same on each kernel this CPU has."""
    if not _has_avx512() and "avx_vnni" not in _cpu_flags():
        pytest.skip("this CPU has one lanes kernel (AVX2): nothing to compare it with")
    for symmetric in (False, True):
        arrays = _weight(48, 384, bits, seed=bits + group_size, group_size=group_size,
                         stype=stype, symmetric=symmetric)  # fmt: skip
        moved = lanes.to_lanes(*arrays, bits)
        out: dict[str, list[np.ndarray[Any, Any]]] = {}
        for isa in LANES_ISAS:
            monkeypatch.setenv(kernels.ENV_ISA, isa)
            assert ext.lanes_usable()
            out[isa] = [_qmatmul(_x(rows, 384, seed=rows), moved, bits, group_size)
                        for rows in (*range(1, 18), 40)]  # fmt: skip
            out[isa].append(np.array(kernels.dequantize(*moved, group_size=group_size, bits=bits)))
        for isa in LANES_ISAS[1:]:
            for got, want in zip(out[isa], out[""], strict=True):
                np.testing.assert_array_equal(got, want, err_msg=isa)


@pytest.mark.parametrize("isa", LANES_ISAS)
@pytest.mark.parametrize("bits", BITS)
def test_prompt_tiles_and_dequantization_give_the_standard_bits(
    ext: Any, monkeypatch: pytest.MonkeyPatch, isa: str, bits: int
) -> None:
    monkeypatch.setenv(kernels.ENV_ISA, isa)
    for symmetric in (False, True):
        arrays = _weight(208, 256, bits, seed=bits, symmetric=symmetric)
        moved = lanes.to_lanes(*arrays, bits)
        x = _x(40, 256)  # past SMALL_ROWS: dequantized tiles through the BLAS
        np.testing.assert_array_equal(_qmatmul(x, moved, bits), _qmatmul(x, arrays, bits))
        got = kernels.dequantize(*moved, group_size=32, bits=bits)
        want = kernels.dequantize(*arrays, group_size=32, bits=bits)
        assert got.shape == (208, 256)
        np.testing.assert_array_equal(np.array(got), np.array(want))


def test_a_gated_pair_in_lanes(ext: Any) -> None:
    def layer(bits: int, seed: int, moved: bool) -> QuantizedLinear:
        out = QuantizedLinear(256, 96, bias=False, group_size=32, bits=bits)
        w, scales, biases = _weight(96, 256, bits, seed=seed)
        if moved:
            w, scales, biases = lanes.to_lanes(w, scales, biases, bits)
        out.update({"weight": w, "scales": scales, "biases": biases})
        return out

    for rows in (1, 3, 40):
        x = _x(rows, 256)
        standard = fused_products(x, (layer(5, 1, False), layer(4, 2, False)), "silu")
        moved = fused_products(x, (layer(5, 1, True), layer(4, 2, True)), "silu")
        assert standard is not None and moved is not None
        got, want = np.array(moved[0]), np.array(standard[0])
        if rows > primitives.SMALL_ROWS or not ext.lanes_usable():
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_mlx_reads_lanes_where_the_primitives_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = _weight(48, 256, 4, seed=2)
    moved = lanes.to_lanes(*arrays, 4)
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    x = _x(3, 256)
    want = mx.quantized_matmul(x, *arrays[:2], arrays[2], group_size=32, bits=4)
    np.testing.assert_array_equal(_qmatmul(x, moved, 4), np.array(want))
    got = kernels.dequantize(*moved, group_size=32, bits=4)
    np.testing.assert_array_equal(
        np.array(got),
        np.array(mx.dequantize(*arrays[:2], arrays[2], group_size=32, bits=4)),
    )


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("symmetric", (False, True))
def test_an_embedding_in_lanes_looks_up_the_same_rows(ext: Any, bits: int, symmetric: bool) -> None:
    table = QuantizedEmbedding.from_embedding(Embedding(96, 256), 32, bits)
    w, scales, biases = _weight(96, 256, bits, seed=bits, symmetric=symmetric)
    table.update({"weight": w, "scales": scales})
    if symmetric:
        del table["biases"]
        object.__setattr__(table, "biases", None)
    else:
        table.update({"biases": biases})
    ids = mx.array([[0, 5, 17, 95], [16, 15, 31, 2]])
    x = _x(2, 256)
    want, want_head = np.array(table(ids)), np.array(table.as_linear(x))
    assert use_lanes(table) == (1 if kernels.lanes_ready() else 0)
    if not kernels.lanes_ready():
        pytest.skip("weights stay standard here")
    assert lanes.in_lanes(table["weight"])
    np.testing.assert_array_equal(np.array(table(ids)), want)
    np.testing.assert_allclose(np.array(table.as_linear(x)), want_head, rtol=1e-3, atol=1e-3)


class _Reads(Module):
    reads_weights = ("kept",)

    def __init__(self) -> None:
        super().__init__()
        self.kept = QuantizedLinear(256, 32, group_size=32, bits=4)
        self.moved = QuantizedLinear(256, 32, group_size=32, bits=4)
        self.odd = QuantizedLinear(256, 40, group_size=32, bits=4)  # not whole strips


def test_use_lanes_moves_what_fits_and_what_no_parent_reads(
    ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels.lanes_ready():
        pytest.skip("weights stay standard here")
    model = _Reads()
    assert use_lanes(model) == 1
    assert lanes.in_lanes(model.moved["weight"])
    assert not lanes.in_lanes(model.kept["weight"]) and not lanes.in_lanes(model.odd["weight"])
    for name, value in ((primitives.ENV_LANES, "0"), (primitives.ENV_ACTIVATIONS, "int8")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert use_lanes(_Reads()) == 0
