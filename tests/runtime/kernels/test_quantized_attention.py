"""Attention over a quantized KV cache: the CPU kernel (kernels.c
`mlxgw_attention_quantized`) and the MLX-ops path (runtime/models/quantized_attention.py,
what Metal and CUDA run) against the oracle: MLX's float32 dequantize, then MLX's fused
attention with the equivalent boolean mask."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime.cache import Quantized
from runtime.cache.quantized import quantize
from runtime.kernels import bridge
from runtime.models import quantized_attention as qa

RTOL = 2e-5  # of the largest output: float32 sums in another order


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(previous)


@pytest.fixture(params=["native", "generic"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The kernels as this CPU runs them, then their portable code (what ARM runs); a
    missing build skips locally and fails under CI."""
    monkeypatch.setenv(bridge.ENV_ISA, request.param)
    monkeypatch.setattr(bridge, "_load", functools.cache(bridge._load.__wrapped__))
    loaded = bridge.kernels()
    if loaded is None:
        reason = "the CPU kernels are not built (pip install -e . builds them)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    if request.param == "generic":
        assert loaded.isa == "generic"
    yield request.param


def _case(
    shape: Sequence[int], *, bits: int, group: int, seed: int, spare: int = 5, rotated: bool = False
) -> tuple[mx.array, Quantized, Quantized]:
    """Queries for (batch, q heads, kv heads, rows, keys, head_dim), and keys/values
    quantized as a cache holds them: views of the first `keys` columns of bigger buffers
    (a cache's capacity); `rotated`: keys rotated, as a cache stores them."""
    batch, heads, kv_heads, length, keys, dim = shape
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, length, dim))
    k = mx.random.normal((batch, kv_heads, keys + spare, dim)) * 2
    v = mx.random.normal((batch, kv_heads, keys + spare, dim))
    qk, qv = quantize(k, bits, group, rotated=rotated), quantize(v, bits, group)
    return q, qk.span(0, keys), qv.span(0, keys)


def _mask(
    batch: int, length: int, keys: int, causal: bool, starts: Sequence[int] | None
) -> mx.array:
    k_pos = mx.arange(keys)[None, None, None, :]
    q_pos = mx.arange(keys - length, keys)[None, None, :, None]
    allowed = mx.ones((batch, 1, length, keys), dtype=mx.bool_)
    if causal:
        allowed = allowed & (k_pos <= q_pos)
    if starts is not None:
        allowed = allowed & (k_pos >= mx.array(list(starts))[:, None, None, None])
    return allowed


def _reference(
    q: mx.array, keys: Quantized, values: Quantized, scale: float, mask: mx.array
) -> mx.array:
    k, v = keys.dequantize(), values.dequantize()
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _close(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    assert err <= RTOL * float(mx.abs(want).max()), err


SHAPES = [
    # batch, q heads, kv heads, query rows, keys, head_dim
    (1, 14, 2, 1, 300, 64),  # a decode step (Qwen2.5-0.5B's heads)
    (1, 4, 2, 37, 531, 64),  # a prefill chunk, keys past one key block
    (1, 3, 3, 5, 5, 128),  # a first chunk: no earlier keys, no grouping
    (3, 4, 1, 1, 17, 64),  # a batch's decode step
    (2, 2, 2, 65, 70, 96),  # more rows than a query block; head_dim 96 in groups of 32
]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_the_kernel_equals_dequantize_then_attention(
    bits: int, group: int, shape: tuple[int, ...], causal: bool, isa: str
) -> None:
    batch, _, _, length, keys, dim = shape
    q, k, v = _case(shape, bits=bits, group=group, seed=keys + dim)
    if k.group_size != group:  # a head_dim the group does not divide: 32 instead
        assert dim % group and k.group_size == 32
    starts = [(7 * i) % (keys - length + 1) for i in range(batch)] if batch > 1 else None
    scale = dim**-0.5
    out = bridge.quantized_attention(
        q, k.arrays, v.arrays, bits=bits, group_size=k.group_size, scale=scale,
        causal=causal, starts=starts,
    )  # fmt: skip
    assert out is not None
    _close(out, _reference(q, k, v, scale, _mask(batch, length, keys, causal, starts)))


def test_thread_counts_give_the_same_bits(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _case((2, 8, 2, 9, 600, 64), bits=8, group=64, seed=1)
    outs = []
    for threads in ("1", "3"):
        monkeypatch.setenv(bridge.ENV_THREADS, threads)
        monkeypatch.setattr(bridge, "_load", functools.cache(bridge._load.__wrapped__))
        out = bridge.quantized_attention(
            q, k.arrays, v.arrays, bits=8, group_size=64, scale=0.125, causal=True
        )
        assert out is not None
        outs.append(np.array(out))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_half_precision_queries_come_back_in_their_dtype(isa: str) -> None:
    q, k, v = _case((1, 4, 2, 3, 40, 64), bits=8, group=64, seed=2)
    out = bridge.quantized_attention(
        q.astype(mx.bfloat16), k.arrays, v.arrays, bits=8, group_size=64, scale=0.125, causal=True
    )
    assert out is not None and out.dtype == mx.bfloat16


def test_what_the_kernel_does_not_take_falls_back(isa: str) -> None:
    q, k, v = _case((1, 4, 2, 3, 40, 64), bits=8, group=64, seed=3)
    call = functools.partial(bridge.quantized_attention, scale=0.125, causal=True)
    assert call(q, k.arrays, v.arrays, bits=4, group_size=64) is None  # codes of 8 bits
    assert call(q, k.arrays, v.arrays, bits=8, group_size=32) is None  # groups of 64
    assert call(q, k.arrays, v.arrays, bits=8, group_size=64, starts=[0, 0]) is None
    short = k.span(0, 2).arrays
    assert call(q, short, short, bits=8, group_size=64) is None  # fewer keys than queries


# -- the model's entry point: the kernel where it applies, MLX's ops otherwise --


def _window(length: int, keys: int, window: int) -> mx.array:
    q_pos = mx.arange(keys - length, keys)[:, None]
    k_pos = mx.arange(keys)[None, :]
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_attention_equals_its_oracle_for_every_mask(
    kernels: str, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kernels off this is the path Metal and CUDA take (mx.quantized_matmul on
    the codes); on, the kernel takes what it can and MLX the rest. The keys are rotated,
    as a cache holds them: the oracle reads them rotated back."""
    monkeypatch.setenv(bridge.ENV_SWITCH, "1" if kernels == "on" else "0")
    cases: list[tuple[tuple[int, ...], Any, Sequence[int] | None, mx.array | None]] = []
    # decode (no mask), a causal prefill, one past a query block (blocked), a window
    cases.append(((1, 4, 2, 1, 50, 64), None, None, None))
    cases.append(((1, 4, 2, 40, 90, 64), "causal", None, _mask(1, 40, 90, True, None)))
    cases.append(((1, 2, 1, 300, 310, 64), "causal", None, _mask(1, 300, 310, True, None)))
    win = _window(6, 30, 8)
    cases.append(((1, 4, 2, 6, 30, 64), win, None, win))
    # a batch's decode step: its padding as a mask, and told to the kernel
    pad = [3, 0, 10]
    batch_mask = _mask(3, 1, 20, True, pad)
    cases.append(((3, 4, 2, 1, 20, 64), batch_mask, pad, batch_mask))
    # head_dims quantized padded to a multiple of 32 (16 as 32, 80 as 96)
    cases.append(((1, 4, 2, 1, 50, 16), None, None, None))
    cases.append(((2, 4, 2, 40, 45, 80), "causal", None, _mask(2, 40, 45, True, None)))
    for shape, mask, padding, oracle_mask in cases:
        q, k, v = _case(shape, bits=bits, group=64, seed=shape[3], rotated=True)
        scale = shape[-1] ** -0.5
        got = qa.quantized_attention(q, k, v, scale=scale, mask=mask, padding=padding, block=128)
        k_f, v_f = k.dequantize(shape[-1]), v.dequantize(shape[-1])
        want = mx.fast.scaled_dot_product_attention(q, k_f, v_f, scale=scale, mask=oracle_mask)
        _close(got, want)
