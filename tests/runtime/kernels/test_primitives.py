"""The quantized MLX primitives (runtime/kernels/ext: quantized.c, qdot.c) against
dequantize-then-matmul.

The oracle is MLX's own format: `mx.quantize` packs a random float32 weight, and the
float64 product with `mx.dequantize` of the same arrays is what the kernels approximate.
Float paths are held to float32 rounding (relative to |x| @ |W|.T, the size of the terms
summed, so not a cancellation artefact); the int8-activation path (qdot.c) to the bound
its rounding of x implies, computed here from x and W.
"""

from __future__ import annotations

import itertools
import platform
import sys
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime import kernels
from runtime.kernels import primitives

RTOL = 1e-5
ROWS = (1, 2, 3, 4, 5, 7, 8, 16, 17, 40)  # up to 16: decode kernels; above: tiles + BLAS
SHAPES = ((67, 128), (129, 384))  # (out_features, in_features): odd N, K a group multiple
ALL_BITS = (2, 3, 4, 5, 6, 8)
SCALE_TYPES = (mx.float32, mx.float16, mx.bfloat16)


def test_the_extension_loads_where_it_is_expected() -> None:
    """CI cannot pass on the slow fallback unnoticed: on x86-64 (and aarch64) Linux the
    extension must have been built and must match the installed MLX."""
    if not (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")):
        pytest.skip("the extension is built on Linux only")
    module = primitives.extension()
    assert module is not None, "the MLX extension did not load (pip install -e . builds it)"
    assert module.mlx_version == primitives.mlx_version() == module.mlx_header_version
    assert kernels.quantized_ready()


def _packed(
    cols: int, depth: int, bits: int, group_size: int, seed: int, stype: mx.Dtype = mx.float32
) -> tuple[mx.array, mx.array, mx.array, np.ndarray[Any, Any]]:
    """(w, scales, biases) and the dequantized weight in float64 (scales rounded first)."""
    rng = np.random.default_rng(seed)
    weight = mx.array(rng.standard_normal((cols, depth), dtype=np.float32))
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    scales, biases = scales.astype(stype), biases.astype(stype)
    dense = mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits
    )
    mx.eval(w, scales, biases, dense)
    return w, scales, biases, np.asarray(dense).astype(np.float64)


def _error(got: mx.array, x: mx.array, dense: np.ndarray[Any, Any]) -> float:
    x64 = np.asarray(x).astype(np.float64).reshape(-1, dense.shape[1])
    out = np.asarray(got).astype(np.float64).reshape(x64.shape[0], -1)
    scale = np.abs(x64) @ np.abs(dense).T + 1e-30
    return float((np.abs(out - x64 @ dense.T) / scale).max())


def _qmatmul(x: mx.array, w: mx.array, s: mx.array, b: mx.array, **kw: Any) -> mx.array:
    out = kernels.qmatmul(x, w, s, b, **kw)
    mx.eval(out)
    return out


@pytest.mark.parametrize("isa", ["avx2", "generic"])
@pytest.mark.parametrize("bits", ALL_BITS)
def test_float_paths_match_dequantize_then_matmul(
    bits: int, isa: str, ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every width, group size and scale type; rows through the decode kernel and through
    the tiles-into-BLAS path; odd shapes and thread counts."""
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, "float32")
    if isa == "generic":
        monkeypatch.setenv(kernels.ENV_ISA, "generic")
    threads = itertools.cycle((1, 2, 3))
    cases = itertools.product((32, 64, 128), SCALE_TYPES, enumerate(SHAPES))
    rng = np.random.default_rng(bits)
    for group_size, stype, (seed, (cols, depth)) in cases:
        w, s, b, dense = _packed(cols, depth, bits, group_size, seed, stype)
        for rows in ROWS:
            monkeypatch.setenv(kernels.ENV_THREADS, str(next(threads)))
            x = mx.array(rng.standard_normal((rows, depth), dtype=np.float32))
            got = _qmatmul(x, w, s, b, group_size=group_size, bits=bits)
            assert got.shape == (rows, cols) and got.dtype == mx.float32
            error = _error(got, x, dense)
            assert error <= RTOL, (group_size, stype, rows, cols, error)


def _rounding_bound(x: np.ndarray[Any, Any], dense: np.ndarray[Any, Any], top: int) -> Any:
    """|out - exact| <= sum over blocks of 32 of max|x_block| / (2 top) * sum |w - centre|,
    w - centre being what meets the rounded x (qdot.c; 8-bit weights are centred by 128
    steps of their group's scale, whose product with x the bias term takes exactly)."""
    rows, depth = x.shape
    blocks = np.abs(x.reshape(rows, depth // 32, 32)).max(axis=2) / (2.0 * top)  # (rows, blocks)
    return blocks @ np.abs(dense).reshape(dense.shape[0], depth // 32, 32).sum(axis=2).T


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (none where /proc/cpuinfo says none)."""
    try:
        with open("/proc/cpuinfo") as info:
            return set(info.read().split("flags", 2)[1].split("\n")[0].split())
    except (OSError, IndexError):
        return set()


def _has_avx512() -> bool:
    """Whether qdot512.c runs here (the flags it checks, as the kernel reads them)."""
    need = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512vbmi")
    return all(f in _cpu_flags() for f in need)


# int16 rows run on AVX-512 where the CPU has it (qdot512.c), else AVX2 (qdot.c); "avx2"
# forces the second on a machine that has the first, so both are checked here
INT16_ISAS = ("", "avx2")


@pytest.mark.parametrize(
    ("activations", "top", "isa"),
    [("int8", 127, ""), ("int16", 32767, ""), ("int16", 32767, "avx2")],
)
@pytest.mark.parametrize("bits", ALL_BITS)
def test_integer_paths_stay_within_their_rounding_bound(
    bits: int, activations: str, top: int, isa: str, ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows (up to SMALL_ROWS) meet x rounded to int8 or int16 per block of 32; the
    error is the bound that rounding implies (8-bit weights meet int8 x centred: bounded
    above by the centre's size)."""
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, activations)
    monkeypatch.setenv(kernels.ENV_ISA, isa)
    rng = np.random.default_rng(bits + 10)
    for group_size, stype, (seed, (cols, depth)) in itertools.product(
        (32, 64, 128), SCALE_TYPES, enumerate(SHAPES)
    ):
        w, s, b, dense = _packed(cols, depth, bits, group_size, seed, stype)
        # the weights that meet x: 8-bit centred (dense - scale*128 - ...): bound with dense
        # plus the centre's size, |s| * 128 per weight
        scales = np.repeat(np.abs(np.asarray(s.astype(mx.float32))), group_size, axis=1)
        centred = np.abs(dense) + (scales * 128 if bits == 8 and top == 127 else 0)
        for rows in (1, 2, 3, 5, 16):
            x_np = rng.standard_normal((rows, depth), dtype=np.float32)
            got = np.asarray(_qmatmul(mx.array(x_np), w, s, b, group_size=group_size, bits=bits))
            exact = x_np.astype(np.float64) @ dense.T
            bound = _rounding_bound(x_np, centred, top)
            slack = RTOL * (np.abs(x_np.astype(np.float64)) @ centred.T)
            assert (np.abs(got - exact) <= bound + slack).all(), (group_size, stype, rows)
            # and the rounding is real but small: far from zero, far below the bound's size
            assert np.abs(got - exact).max() > 0


@pytest.mark.parametrize("isa", INT16_ISAS)
@pytest.mark.parametrize("bits", ALL_BITS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(
    bits: int, isa: str, ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch stays invariant: each row of an N-row decode product equals that row
    multiplied alone, bit for bit, for every N the decode kernels take (1 to 16, past
    one pass of rows per weight read) and group size."""
    monkeypatch.setenv(kernels.ENV_ISA, isa)
    for group_size in (32, 64, 128):
        w, s, b, _ = _packed(67, 384, bits, group_size, seed=bits, stype=mx.float16)
        x_np = np.random.default_rng(bits).standard_normal((16, 384), dtype=np.float32)
        alone = [
            np.asarray(
                _qmatmul(mx.array(x_np[i : i + 1]), w, s, b, group_size=group_size, bits=bits)
            )
            for i in range(16)
        ]
        for rows in (2, 5, 8, 9, 16):
            got = np.asarray(
                _qmatmul(mx.array(x_np[:rows]), w, s, b, group_size=group_size, bits=bits)
            )
            for i in range(rows):
                np.testing.assert_array_equal(got[i], alone[i][0], err_msg=f"{rows} rows, row {i}")


def test_avx512_runs_where_the_cpu_has_it(ext: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AVX-512 VNNI/VBMI the int16 rows take qdot512.c: its float sums run
    in 16 lanes, so its results differ from the AVX2 path's by rounding (and only that)."""
    if not _has_avx512():
        pytest.skip("this CPU has no AVX-512 VNNI/VBMI")
    w, s, b, _ = _packed(129, 384, 5, 32, seed=5, stype=mx.float16)
    x = mx.array(np.random.default_rng(5).standard_normal((3, 384), dtype=np.float32))
    out = {}
    for isa in INT16_ISAS:
        monkeypatch.setenv(kernels.ENV_ISA, isa)
        out[isa] = np.asarray(_qmatmul(x, w, s, b, group_size=32, bits=5))
    rel = np.abs(out[""] - out["avx2"]).max() / np.abs(out["avx2"]).max()
    assert 0 < rel < 1e-5


def test_int8_and_float_paths_differ_only_by_rounding(
    ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    w, s, b, dense = _packed(129, 384, 4, 64, seed=7)
    x = mx.array(np.random.default_rng(7).standard_normal((3, 384), dtype=np.float32))
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, "int8")
    int8 = np.asarray(_qmatmul(x, w, s, b, group_size=64, bits=4))
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, "float32")
    floats = np.asarray(_qmatmul(x, w, s, b, group_size=64, bits=4))
    assert _error(mx.array(floats), x, dense) <= RTOL
    rel = np.abs(int8 - floats).max() / np.abs(floats).max()
    assert 0 < rel < 2e-2


def test_thread_count_does_not_change_results(ext: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each output is summed in the same order whichever thread computes it."""
    w, s, b, _ = _packed(129, 384, 4, 64, seed=3)
    x = mx.array(np.random.default_rng(3).standard_normal((5, 384), dtype=np.float32))
    outs = []
    for threads in (1, 2, 3, 64):
        monkeypatch.setenv(kernels.ENV_THREADS, str(threads))
        outs.append(np.asarray(_qmatmul(x, w, s, b, group_size=64, bits=4)))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_leading_axes_and_lazy_graphs(ext: Any) -> None:
    """(B, L, K) inputs keep their leading axes; the op composes in a lazy graph, under
    mx.compile, and pipelines with async_eval."""
    w, s, b, dense = _packed(67, 128, 8, 32, seed=4)
    x = mx.array(np.random.default_rng(4).standard_normal((2, 3, 128), dtype=np.float32))

    def f(v: mx.array) -> mx.array:
        return kernels.qmatmul(v, w, s, b, group_size=32, bits=8) * 2.0 + 1.0

    eager, compiled = f(x), mx.compile(f)(x)
    mx.async_eval(eager)
    mx.eval(eager, compiled)
    assert eager.shape == (2, 3, 67)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(compiled), rtol=1e-6, atol=1e-6)
    assert _error((eager - 1.0) / 2.0, x, dense) <= 1e-4  # int16 rows; bounds above


def test_a_transposed_input_is_read_as_its_values(ext: Any) -> None:
    w, s, b, dense = _packed(67, 128, 4, 64, seed=5)
    base = mx.array(np.random.default_rng(5).standard_normal((128, 20), dtype=np.float32))
    x = base.T  # not row-contiguous: the op copies it
    got = _qmatmul(x, w, s, b, group_size=64, bits=4)
    assert _error(got, x, dense) <= 1e-2


def test_dequantize_equals_mlx(ext: Any) -> None:
    for bits, group_size, stype in itertools.product(ALL_BITS, (32, 128), SCALE_TYPES):
        w, s, b, dense = _packed(33, 256, bits, group_size, seed=bits, stype=stype)
        got = kernels.dequantize(w, s, b, group_size=group_size, bits=bits)
        np.testing.assert_allclose(np.asarray(got), dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("bits", "group_size", "message"),
    [(7, 64, "bits must be"), (4, 16, "group_size must be"), (4, 256, "group_size must be")],
)
def test_unsupported_formats_are_refused(
    bits: int, group_size: int, message: str, ext: Any
) -> None:
    depth, cols = 256, 8
    x = mx.zeros((1, depth))
    w = mx.zeros((cols, depth * bits // 32), dtype=mx.uint32)
    groups = mx.zeros((cols, depth // group_size))
    with pytest.raises(ValueError, match=message):
        ext.quantized_matmul(
            x, w, groups, groups, group_size=group_size, bits=bits, threads=1, generic=False,
            small_rows=16, x_bits=16,
        )  # fmt: skip


def test_shapes_that_do_not_match_are_refused(ext: Any) -> None:
    w, s, b, _ = _packed(8, 128, 4, 64, seed=5)
    with pytest.raises(ValueError, match="shapes do not match"):  # K not the weight's
        kernels.qmatmul(mx.zeros((1, 96)), w, s, b, group_size=64, bits=4)
    with pytest.raises(ValueError, match="shapes do not match"):  # another width's packing
        kernels.qmatmul(mx.zeros((1, 128)), w, s, b, group_size=64, bits=8)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        kernels.qmatmul(mx.zeros((1, 128)), w, s.astype(mx.int32), b.astype(mx.int32),
                        group_size=64, bits=4)  # fmt: skip


def test_without_the_extension_mlx_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing or mismatched build: MLX's own op, same values (slowly); quantized
    weights are then not kept on the CPU."""
    monkeypatch.setattr(primitives, "extension", lambda: None)
    with mx.stream(mx.cpu):
        w, s, b, dense = _packed(8, 64, 4, 64, seed=6)
        x = mx.array(np.random.default_rng(6).standard_normal((2, 64), dtype=np.float32))
        assert _error(_qmatmul(x, w, s, b, group_size=64, bits=4), x, dense) <= RTOL
        assert not kernels.quantized_ready() or mx.default_device() != mx.cpu


def test_a_build_for_another_mlx_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Stale:
        mlx_version = "0.0.1"

    primitives.extension.cache_clear()
    monkeypatch.setattr("importlib.import_module", lambda name: Stale())
    try:
        assert primitives.extension() is None
        assert "built for mlx 0.0.1" in caplog.text
    finally:
        primitives.extension.cache_clear()


def test_quantized_layers_multiply_through_the_primitive(
    ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The models' quantized Linear and tied-embedding head use `qmatmul` (float path
    here: the int8 rounding has its own test above)."""
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, "float32")
    from runtime.models.linear import Embedding, Linear

    rng = np.random.default_rng(8)
    linear = Linear(128, 40, bias=True)
    linear.weight = mx.array(rng.standard_normal((40, 128), dtype=np.float32))
    linear.bias = mx.array(rng.standard_normal(40, dtype=np.float32))
    quantized = linear.to_quantized(group_size=64, bits=8)
    x = mx.array(rng.standard_normal((1, 128), dtype=np.float32))
    dense = mx.dequantize(
        quantized.weight, quantized.scales, quantized.biases, group_size=64, bits=8
    )
    want = np.asarray(x @ dense.T + linear.bias)
    np.testing.assert_allclose(np.asarray(quantized(x)), want, rtol=1e-4, atol=1e-4)
    embedding = Embedding(40, 128)
    embedding.weight = linear.weight
    table = embedding.to_quantized(group_size=64, bits=8)
    np.testing.assert_allclose(
        np.asarray(table.as_linear(x)), np.asarray(x @ dense.T), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        np.asarray(table(mx.array([3]))), np.asarray(dense[3:4]), rtol=1e-6, atol=1e-6
    )


def test_the_thread_pool_survives_changing_thread_counts(
    ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back-to-back calls whose thread counts go up and down (pool.c: a pool thread that
    sits out one call must not run the next one's work twice)."""
    w, s, b, _ = _packed(257, 256, 4, 64, seed=9)
    x = mx.array(np.random.default_rng(9).standard_normal((3, 256), dtype=np.float32))
    want = np.asarray(_qmatmul(x, w, s, b, group_size=64, bits=4))
    counts = np.random.default_rng(10).integers(1, 5, size=300)
    for count in counts:
        monkeypatch.setenv(kernels.ENV_THREADS, str(int(count)))
        np.testing.assert_array_equal(np.asarray(_qmatmul(x, w, s, b, group_size=64, bits=4)), want)
