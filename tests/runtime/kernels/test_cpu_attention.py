"""The CPU kernels (runtime/kernels/kernels.c) against MLX's own ops, and their fallback.

The oracle is MLX: `mx.fast.scaled_dot_product_attention` (via `base.attention` with the
kernels switched off) and MLX's activations. The tiny-model tests in test_models.py
compare the same path with transformers.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from runtime.cache import KVCache, Mask
from runtime.kernels import bridge as cpu_kernels
from runtime.models import base, build_model

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    """The kernels serve only MLX's CPU device (a Mac's default is the GPU)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(previous)


def _fresh_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the loaded library, so the next call loads (and logs) again."""
    monkeypatch.setattr(cpu_kernels, "_load", functools.cache(cpu_kernels._load.__wrapped__))


@pytest.fixture
def built() -> cpu_kernels.Kernels:
    """The loaded kernels; a missing build skips locally and fails under CI."""
    loaded = cpu_kernels.kernels()
    if loaded is None:
        reason = "the CPU kernels are not built (pip install -e . builds them)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return loaded


@pytest.fixture(params=["native", "generic"])
def any_isa(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[cpu_kernels.Kernels]:
    """The kernels as this CPU runs them, then their portable code (what ARM runs)."""
    monkeypatch.setenv(cpu_kernels.ENV_ISA, request.param)
    _fresh_load(monkeypatch)
    loaded = cpu_kernels.kernels()
    if loaded is None:
        pytest.skip("the CPU kernels are not built (pip install -e . builds them)")
    if request.param == "generic":
        assert loaded.isa == "generic"
    yield loaded


def _qkv(
    batch: int, q_heads: int, kv_heads: int, length: int, keys: int, dim: int, seed: int
) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(seed)
    q = mx.random.normal((batch, q_heads, length, dim))
    k = mx.random.normal((batch, kv_heads, keys, dim))
    v = mx.random.normal((batch, kv_heads, keys, dim))
    return q, k, v


def _mlx_attention(
    q: mx.array, k: mx.array, v: mx.array, mask: Mask, monkeypatch: pytest.MonkeyPatch
) -> np.ndarray[Any, Any]:
    with monkeypatch.context() as patch:
        patch.setenv(cpu_kernels.ENV_SWITCH, "0")
        out = base.attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)
        return np.array(out)


# (batch, q heads, kv heads, queries, keys, head dim): GQA ratios 1, 2 and 7, head dims
# 64 and 128 (and odd ones), queries not a multiple of the kernel's blocks, keys before
# the queries (a cache offset), batch 2, fewer queries than MIN_ROWS over many keys.
SHAPES = [
    (1, 14, 2, 2048 // 8, 1100, 64),
    (1, 4, 4, 33, 33, 128),
    (2, 8, 4, 100, 357, 64),
    (2, 6, 3, 70, 70, 128),
    (1, 2, 1, 257, 1000, 16),
    (1, 3, 3, 40, 300, 80),
    (1, 14, 2, 5, 3000, 64),  # a short chunk over a long context (MIN_SCORES)
    (1, 14, 2, 48, 9000, 64),  # past 8k keys (an agent's first prompt)
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_mlx_attention(
    shape: tuple[int, ...], causal: bool, any_isa: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch, q_heads, kv_heads, length, keys, dim = shape
    q, k, v = _qkv(batch, q_heads, kv_heads, length, keys, dim, seed=sum(shape))
    mask: Literal["causal"] | None = "causal" if causal else None
    got = cpu_kernels.attention(q, k, v, scale=shape[-1] ** -0.5, causal=causal)
    assert got is not None and got.shape == q.shape
    np.testing.assert_allclose(np.array(got), _mlx_attention(q, k, v, mask, monkeypatch), atol=ATOL)
    # and through the dispatch every model uses: the same kernel, except that a causal
    # block of up to 16 queries (a speculative step's verify rows) runs in the decode
    # kernel (tests/runtime/kernels/test_layer_primitives.py), its keys split otherwise
    dispatched = np.array(base.attention(q, k, v, scale=shape[-1] ** -0.5, mask=mask))
    same_kernel = not causal or length > 16
    np.testing.assert_allclose(dispatched, np.array(got), atol=0 if same_kernel else ATOL)


def test_strided_cache_views(built: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys and values as a KVCache hands them over: views into a larger buffer."""
    cache = KVCache(step=256)
    q, k, v = _qkv(1, 4, 2, 96, 96, 64, seed=3)
    cache.update_and_fetch(k[:, :, :50], v[:, :, :50])
    keys, values = cache.update_and_fetch(k[:, :, 50:], v[:, :, 50:])
    assert np.asarray(keys).strides[1] != 96 * 64 * 4  # really a strided view
    tail = q[:, :, 50:]
    got = cpu_kernels.attention(tail, keys, values, scale=0.125, causal=True)
    assert got is not None
    want = _mlx_attention(tail, keys, values, "causal", monkeypatch)
    np.testing.assert_allclose(np.array(got), want, atol=ATOL)


def _float64_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> Any:
    qn, kn, vn = (np.array(x).astype(np.float64) for x in (q, k, v))
    group = qn.shape[1] // kn.shape[1]
    kn, vn = np.repeat(kn, group, axis=1), np.repeat(vn, group, axis=1)
    length, keys = qn.shape[2], kn.shape[2]
    scores = qn @ kn.swapaxes(-1, -2) * scale
    seen = np.arange(keys)[None, :] <= (keys - length + np.arange(length))[:, None]
    scores = np.where(seen, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (probs / probs.sum(axis=-1, keepdims=True)) @ vn


def test_scores_beyond_exp_range(built: Any) -> None:
    """Scores in the thousands, which exp alone would overflow: the running max keeps
    them finite (float32 itself limits the agreement at this scale)."""
    q, k, v = _qkv(1, 4, 2, 64, 150, 64, seed=4)
    q, k = q * 20, k * 20
    got = cpu_kernels.attention(q, k, v, scale=0.125, causal=True)
    assert got is not None
    out = np.array(got)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, _float64_attention(q, k, v, 0.125), atol=1e-3)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_inputs_come_back_in_their_dtype(
    dtype: mx.Dtype, built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v = (x.astype(dtype) for x in _qkv(1, 4, 2, 40, 64, 64, seed=5))
    got = cpu_kernels.attention(q, k, v, scale=0.125, causal=True)
    assert got is not None and got.dtype == dtype
    q32, k32, v32 = (x.astype(mx.float32) for x in (q, k, v))
    want = _mlx_attention(q32, k32, v32, "causal", monkeypatch)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=1e-2)


def test_thread_count_does_not_change_results(built: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(2, 4, 2, 200, 260, 64, seed=7)
    runs = []
    for threads in ("1", "3"):
        monkeypatch.setenv(cpu_kernels.ENV_THREADS, threads)
        _fresh_load(monkeypatch)
        out = cpu_kernels.attention(q, k, v, scale=0.125, causal=True)
        assert out is not None
        runs.append(np.array(out))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_decode_sized_and_unsupported_calls_use_mlx(built: Any) -> None:
    q, k, v = _qkv(1, 4, 2, 8, 40, 64, seed=9)
    assert cpu_kernels.attention(q, k, v, scale=0.125, causal=True) is None  # too few queries
    q, k, v = _qkv(1, 4, 2, 40, 40, 64, seed=9)
    assert cpu_kernels.attention(q, k, v[..., :32], scale=0.125, causal=True) is None
    assert cpu_kernels.attention(q, k, v.astype(mx.int32), scale=0.125, causal=True) is None
    gate = mx.random.normal((1, 8, 128))
    assert cpu_kernels.gated_mul(gate, gate, "silu") is None  # decode-sized
    assert cpu_kernels.gated_mul(mx.zeros((1, 40, 128)), gate, "silu") is None  # shapes differ
    assert cpu_kernels.gated_mul(gate, gate, "relu") is None


def _gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(1, 40, 96), (2, 333, 771)])
def test_gated_mul_matches_mlx(activation: str, shape: tuple[int, ...], any_isa: Any) -> None:
    mx.random.seed(11)
    # wide enough to reach exp's clamps (|x| > 88) as well as the region around 0
    gate = mx.random.normal(shape) * 40
    up = mx.random.normal(shape)
    act = base.activation("silu") if activation == "silu" else _gelu_tanh
    got = cpu_kernels.gated_mul(gate, up, activation)
    assert got is not None
    want = np.array(act(gate) * up)
    np.testing.assert_allclose(np.array(got), want, atol=ATOL, rtol=1e-5)


def test_disabled_by_env_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    q, k, v = _qkv(1, 4, 2, 40, 40, 64, seed=13)
    assert cpu_kernels.kernels() is None
    assert cpu_kernels.attention(q, k, v, scale=0.125, causal=True) is None
    assert cpu_kernels.gated_mul(q, q, "silu") is None
    assert cpu_kernels.linear(q[0, 0, :2], q[0, 0]) is None
    out = base.attention(q, k, v, scale=0.125, mask="causal")
    assert out.shape == q.shape


def test_an_unknown_isa_is_named_once_at_load_and_the_kernels_still_load(
    built: cpu_kernels.Kernels, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for isa in ("", *cpu_kernels.ISAS, "AVX2"):
        monkeypatch.setenv(cpu_kernels.ENV_ISA, isa)
        assert cpu_kernels.check_isa(), isa
    monkeypatch.setenv(cpu_kernels.ENV_ISA, "avx-512")
    _fresh_load(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.kernels() is not None
        assert cpu_kernels.kernels() is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "'avx-512'" in warnings[0] and all(isa in warnings[0] for isa in cpu_kernels.ISAS)


def test_missing_library_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    _fresh_load(monkeypatch)
    monkeypatch.setattr(cpu_kernels, "library_path", lambda: None)
    q, k, v = _qkv(1, 4, 2, 40, 40, 64, seed=17)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        for _ in range(3):
            assert cpu_kernels.attention(q, k, v, scale=0.125, causal=True) is None
            base.attention(q, k, v, scale=0.125, mask="causal")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not built" in warnings[0].getMessage()

    broken = tmp_path / "_kernels.so"
    broken.write_bytes(b"not a shared library")
    monkeypatch.setattr(cpu_kernels, "library_path", lambda: broken)
    _fresh_load(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.kernels() is None
        assert cpu_kernels.kernels() is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def _tiny_qwen2() -> Any:
    model: Any = build_model(
        {
            "model_type": "qwen2",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
            "max_position_embeddings": 1024,
            "rope_theta": 1_000_000.0,
        }
    )
    mx.random.seed(19)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.2, model.parameters()))
    return model


def _prefill(model: Any, tokens: np.ndarray[Any, Any], sizes: list[int]) -> np.ndarray[Any, Any]:
    caches = model.make_caches()
    outs, start = [], 0
    for size in sizes:
        out = model(mx.array(tokens[:, start : start + size]), caches)
        mx.eval(out)
        outs.append(np.array(out))
        start += size
    return np.concatenate(outs, axis=1)


def test_model_prefill_same_with_and_without_kernels(
    built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole model, one-shot and in chunks at a cache offset, kernels on and off."""
    model = _tiny_qwen2()
    tokens = np.random.default_rng(23).integers(0, 300, size=(1, 180)).astype(np.int32)
    with_kernels = _prefill(model, tokens, [100, 80])
    one_shot = _prefill(model, tokens, [180])
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    without = _prefill(model, tokens, [100, 80])
    np.testing.assert_allclose(with_kernels, without, atol=1e-4, rtol=0)
    np.testing.assert_allclose(one_shot, without, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("depth_cols", [(64, 96), (77, 13), (896, 130), (1024, 2100), (13, 7)])
def test_small_gemm_matches_mlx(
    rows: int, depth_cols: tuple[int, int], any_isa: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A linear layer over a few rows (a batched decode step): odd depths exercise the
    vector tail, widths not a multiple of 4 the columns left after the 4-wide blocks and
    the last work item, odd rows the row left after the 2-high blocks. Every row count
    the kernel may take, whichever BLAS would take the rest."""
    depth, cols = depth_cols
    mx.random.seed(rows * 100 + depth)
    x = mx.random.normal((rows, 1, depth))
    weight = mx.random.normal((cols, depth))
    got = cpu_kernels.linear(x, weight)
    assert got is not None and got.shape == (rows, 1, cols)
    np.testing.assert_allclose(np.array(got), np.array(x @ weight.T), atol=1e-4, rtol=1e-5)


def test_a_rows_product_does_not_depend_on_how_many_rows_came() -> None:
    """Every decode step's and verify step's row count (1 to 16) takes the kernel,
    whichever BLAS is loaded, and a row's product is the same bits at any count: what
    speculative decoding's checks and a stream's batch-independent output rest on."""
    assert cpu_kernels.GEMM_ROWS == (1, 16)
    mx.random.seed(7)
    x = mx.random.normal((16, 896))
    weight = mx.random.normal((130, 896))
    whole = cpu_kernels.linear(x, weight)
    assert whole is not None
    for rows in range(1, 17):
        part = cpu_kernels.linear(x[:rows], weight)
        assert part is not None and np.array_equal(np.array(part), np.array(whole[:rows])), rows
    assert cpu_kernels.linear(mx.random.normal((17, 896)), weight) is None  # MLX's GEMM


def test_linear_layer_uses_the_kernel_only_where_it_applies(built: Any) -> None:
    from runtime.models.linear import Linear

    layer = Linear(48, 24, bias=True)
    mx.eval(layer.parameters())
    few, many = mx.random.normal((2, 3, 48)), mx.random.normal((1, 40, 48))
    assert cpu_kernels.linear(few, layer.weight) is not None
    assert cpu_kernels.linear(many, layer.weight) is None  # prefill-sized: MLX's GEMM
    assert cpu_kernels.linear(few[:1, :1], layer.weight) is not None  # one row too
    assert cpu_kernels.linear(few.astype(mx.float16), layer.weight) is None
    assert cpu_kernels.linear(few, layer.weight.T) is None  # shapes do not fit
    for x in (few, many):
        want = x @ layer.weight.T + layer.bias
        np.testing.assert_allclose(np.array(layer(x)), np.array(want), atol=1e-5, rtol=1e-5)


def test_the_kernel_is_chosen_per_layer_by_its_largest_matrix() -> None:
    """A layer whose largest matrix stays in the CPU's caches runs all on MLX's graph (a
    kernel call would break it); a layer with a big one runs all its linears on the
    kernel; a head outside the layers decides for itself."""
    from mlx.nn.layers.base import Module

    from runtime.models.linear import BLOCK_MIN_WEIGHT_BYTES, Linear, choose_small_gemm

    big = BLOCK_MIN_WEIGHT_BYTES // 4 // 1024 + 1  # rows of 1024 float32 inputs

    class Layer(Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.q = Linear(1024, 64)
            self.mlp = Linear(1024, width)

    class Model(Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [Layer(64), Layer(big)]
            self.head = Linear(1024, big)
            self.small_head = Linear(1024, 8)

    model = Model()
    choose_small_gemm(model)
    small, large = model.layers
    assert not small.q.small_gemm and not small.mlp.small_gemm
    assert large.q.small_gemm and large.mlp.small_gemm
    assert model.head.small_gemm and not model.small_head.small_gemm
    x = mx.random.normal((4, 1, 1024))
    for layer in (small.q, large.q):  # either way, the same product
        np.testing.assert_allclose(
            np.array(layer(x)), np.array(x @ layer.weight.T + layer.bias), atol=1e-4
        )
