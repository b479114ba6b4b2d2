"""The primitives a decoder layer's decode step is made of on the CPU (runtime/kernels/ext),
each against the MLX computation it replaces:

- `quantized_matmuls`: several weights of one x (q/k/v, mixed widths, biases) equal the
  single-weight primitive's outputs bit for bit (the same kernels and rounding of x), and
  a gated pair equals act(gate) * up of those outputs;
- `attention`: MLX's scaled_dot_product_attention, for decode and causal rows, strided
  cache views and batch rows that start after their left padding;
- `rms_norm` and `rope`: mx.fast.rms_norm and mx.fast.rope (MLX's CPU fallbacks).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.nn.layers.activations import gelu_approx, silu
from mlx.nn.layers.quantized import quantize

from runtime import kernels
from runtime.kernels import primitives
from runtime.models.qwen2 import Model, ModelArgs
from runtime.models.rope import RoPE, parse_rope


@pytest.fixture(params=["avx2", "generic"])
def ext(ext: Any, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """conftest's extension, on the CPU's own code and on the portable code."""
    if request.param == "generic":
        monkeypatch.setenv(kernels.ENV_ISA, "generic")
    return ext


def _weight(rng: np.random.Generator, cols: int, depth: int, bits: int) -> kernels.Packed:
    w = mx.array(rng.standard_normal((cols, depth), dtype=np.float32))
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    bias = mx.array(rng.standard_normal(cols, dtype=np.float32))
    return kernels.Packed(q, s.astype(mx.float16), b.astype(mx.float16), bias, 32, bits)


def _single(x: mx.array, p: kernels.Packed) -> mx.array:
    out = kernels.qmatmul(x, p.w, p.scales, p.biases, group_size=p.group_size, bits=p.bits)
    return out if p.bias is None else out + p.bias


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("activations", ["int16", "int8", "float32"])
def test_several_products_equal_one_at_a_time(
    ext: Any, monkeypatch: pytest.MonkeyPatch, rows: int, activations: str
) -> None:
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, activations)
    rng = np.random.default_rng(rows)
    depth = 384  # 12 blocks: the vector groups of 8 and the tail
    parts = [_weight(rng, 96, depth, 5), _weight(rng, 40, depth, 8), _weight(rng, 40, depth, 4)]
    parts[1] = dataclasses.replace(parts[1], bias=None)
    x = mx.array(rng.standard_normal((rows, depth), dtype=np.float32))
    outs = kernels.qmatmuls(x, parts)
    assert outs is not None and len(outs) == 3
    for got, part in zip(outs, parts, strict=True):
        want = _single(x, part)
        assert got.shape == want.shape
        # the bias is added inside the kernel rather than after it: float rounding only
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_gated_pair_is_act_of_gate_times_up(ext: Any, activation: str, rows: int) -> None:
    rng = np.random.default_rng(7)
    gate, up = _weight(rng, 80, 256, 5), _weight(rng, 80, 256, 4)
    x = mx.array(rng.standard_normal((2, rows, 256), dtype=np.float32))
    outs = kernels.qmatmuls(x, [gate, up], activation)
    assert outs is not None and len(outs) == 1 and outs[0].shape == (2, rows, 80)
    g, u = _single(x, gate), _single(x, up)
    act = silu(g) if activation == "silu" else gelu_approx(g)
    want = np.asarray(act * u, dtype=np.float64)
    np.testing.assert_allclose(np.asarray(outs[0]), want, rtol=2e-5, atol=1e-4)


def test_qmatmuls_refuses_a_gated_pair_of_different_shapes(ext: Any) -> None:
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 64), dtype=np.float32))
    with pytest.raises(ValueError, match="two weights of one shape"):
        kernels.qmatmuls(x, [_weight(rng, 8, 64, 4), _weight(rng, 16, 64, 4)], "silu")


def _reference(q: mx.array, k: mx.array, v: mx.array, causal: bool) -> np.ndarray[Any, Any]:
    mask = "causal" if causal and q.shape[2] > 1 else None
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    return np.asarray(out)


@pytest.mark.parametrize(("length", "keys"), [(1, 1), (1, 300), (5, 40), (70, 70)])
def test_attention_equals_mlx(ext: Any, length: int, keys: int) -> None:
    rng = np.random.default_rng(length + keys)
    q = mx.array(rng.standard_normal((2, 6, length, 64), dtype=np.float32))
    # keys and values as a cache hands them over: a view of a longer buffer
    buffer_k = mx.array(rng.standard_normal((2, 2, keys + 64, 64), dtype=np.float32))
    buffer_v = mx.array(rng.standard_normal((2, 2, keys + 64, 64), dtype=np.float32))
    k, v = buffer_k[:, :, :keys], buffer_v[:, :, :keys]
    for causal in (False, True):
        got = kernels.attend(q, k, v, scale=0.125, causal=causal)
        assert got is not None and got.shape == q.shape
        np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, causal), atol=2e-6)


def test_attention_skips_each_rows_left_padding(ext: Any) -> None:
    rng = np.random.default_rng(3)
    starts = [0, 9, 30]
    q = mx.array(rng.standard_normal((3, 4, 2, 32), dtype=np.float32))
    k = mx.array(rng.standard_normal((3, 2, 40, 32), dtype=np.float32))
    v = mx.array(rng.standard_normal((3, 2, 40, 32), dtype=np.float32))
    # padding that would change the answer if it were read
    k[1, :, :9] = 1e3
    v[2, :, :30] = 1e3
    got = kernels.attend(q, k, v, scale=0.125, causal=True, starts=starts)
    assert got is not None
    for row, start in enumerate(starts):
        sl = slice(row, row + 1)
        want = _reference(q[sl], k[sl, :, start:], v[sl, :, start:], True)
        np.testing.assert_allclose(np.asarray(got[sl]), want, atol=2e-6)


# "": the code this CPU runs (AVX2 on x86), then the portable code (what ARM runs)
DECODE_ISAS = ("", "generic")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    # groups of 7, 3, 1, 16, 4 and 5 rows (the AVX2 code's value tiles: 4 rows, then the
    # rest), widths of 8, 16, 32, 6 and 5 vectors of 8 (pairs of them, then one)
    [(14, 2, 64), (9, 3, 64), (8, 8, 128), (16, 1, 64), (4, 1, 256), (10, 2, 48), (6, 3, 40)],
)  # fmt: skip
@pytest.mark.parametrize("keys", [1, 7, 300, 2049])
@pytest.mark.parametrize("isa", DECODE_ISAS)
def test_decode_attention_equals_mlx(
    ext: Any, monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, dim: int, keys: int,
    isa: str,
) -> None:  # fmt: skip
    """One query per sequence (the decode kernel: keys split in chunks across threads,
    merged), batch rows from their first key, on each instruction set's code."""
    monkeypatch.setenv(kernels.ENV_ISA, isa)
    rng = np.random.default_rng(keys + heads)
    q = mx.array(rng.standard_normal((3, heads, 1, dim), dtype=np.float32))
    k = mx.array(rng.standard_normal((3, kv_heads, keys + 16, dim), dtype=np.float32))
    v = mx.array(rng.standard_normal((3, kv_heads, keys + 16, dim), dtype=np.float32))
    k, v = k[:, :, :keys], v[:, :, :keys]
    starts = [0, keys // 2, keys - 1]
    got = kernels.attend(q, k, v, scale=dim**-0.5, causal=True, starts=starts)
    assert got is not None
    for row, start in enumerate(starts):
        sl = slice(row, row + 1)
        want = mx.fast.scaled_dot_product_attention(
            q[sl], k[sl, :, start:], v[sl, :, start:], scale=dim**-0.5
        )
        np.testing.assert_allclose(np.asarray(got[sl]), np.asarray(want), atol=3e-6)


@pytest.mark.parametrize("length", [2, 9, 16])
@pytest.mark.parametrize("isa", DECODE_ISAS)
def test_verify_rows_attend_as_one_query_steps_do(
    ext: Any, monkeypatch: pytest.MonkeyPatch, length: int, isa: str
) -> None:
    """A few causal queries per sequence (a speculative step's verify rows) run in the
    decode kernel: each query's output equals the naive reference, and is the very bits
    a one-query step over the same keys computes (drafted tokens are checked against
    the logits decoding without them would have had), on each instruction set's code."""
    monkeypatch.setenv(kernels.ENV_ISA, isa)
    rng = np.random.default_rng(length)
    keys = 700
    q = mx.array(rng.standard_normal((3, 14, length, 64), dtype=np.float32))
    k = mx.array(rng.standard_normal((3, 2, keys, 64), dtype=np.float32))
    v = mx.array(rng.standard_normal((3, 2, keys, 64), dtype=np.float32))
    starts = [0, 300, keys - length]
    got = kernels.attend(q, k, v, scale=0.125, causal=True, starts=starts)
    assert got is not None
    for i in range(length):
        seen = keys - length + i + 1
        one = kernels.attend(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], scale=0.125,
                             causal=True, starts=starts)  # fmt: skip
        assert one is not None
        assert np.array_equal(np.asarray(got[:, :, i : i + 1]), np.asarray(one))
    for row, start in enumerate(starts):
        sl = slice(row, row + 1)
        want = _reference(q[sl], k[sl, :, start:], v[sl, :, start:], True)
        np.testing.assert_allclose(np.asarray(got[sl]), want, atol=3e-6)


def test_attention_does_not_take_unequal_key_and_value_widths(ext: Any) -> None:
    q = mx.zeros((1, 2, 1, 24))
    assert kernels.attend(q, mx.zeros((1, 2, 4, 24)), mx.zeros((1, 2, 4, 16)), scale=1.0,
                          causal=False) is None  # fmt: skip


@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_equals_mlx(ext: Any, unit_offset: bool) -> None:
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((3, 5, 96), dtype=np.float32)).transpose(1, 0, 2)
    w = mx.array(rng.standard_normal(96, dtype=np.float32))
    got = kernels.rms_norm(x, w, 1e-5, unit_offset)
    assert got is not None
    want = mx.fast.rms_norm(x, 1.0 + w if unit_offset else w, 1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


ROPES = [
    {"rope_theta": 1e6},
    {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 4.0}},
    {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192}},
    {"rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
     "original_max_position_embeddings": 4096}},
]  # fmt: skip


@pytest.mark.parametrize("config", ROPES, ids=["default", "linear", "llama3", "yarn"])
@pytest.mark.parametrize("dims", [64, 32])
def test_rope_equals_mlx(ext: Any, config: dict[str, Any], dims: int) -> None:
    rng = np.random.default_rng(dims)
    rope = RoPE(parse_rope(config), dims)
    # (B, L, H, D) seen as (B, H, L, D), as the attention layers hand it over
    x = mx.array(rng.standard_normal((2, 5, 3, 64), dtype=np.float32)).transpose(0, 2, 1, 3)
    for offset in (0, 30_000, mx.array([3, 7_000], dtype=mx.int32)):
        got = rope(x, offset)
        with pytest.MonkeyPatch.context() as patch:  # MLX's own rope, for the reference
            patch.setattr(kernels, "rope", lambda *a, **k: None)
            want = rope(x, offset)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


def test_the_layer_primitives_are_used_in_a_decode_step(
    ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only built: a quantized decoder's step runs through them (MLX's CPU fallbacks
    for rms_norm and rope would be graphs of many ops)."""
    if os.environ.get(kernels.ENV_ISA) == "generic":
        pytest.skip("one ISA is enough")
    calls: dict[str, int] = {}
    for name in ("qmatmuls", "attend", "rms_norm", "rope"):
        original = getattr(kernels, name)

        def counted(*args: Any, _name: str = name, _fn: Any = original, **kw: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kw)

        monkeypatch.setattr(kernels, name, counted)

    args = ModelArgs.from_config({
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "tie_word_embeddings": True, "rope_theta": 1e4,
    })  # fmt: skip
    model = Model(args)
    quantize(model, group_size=32, bits=4)
    caches = model.make_caches()
    mx.eval(model(mx.array([[1, 2, 3]]), caches))
    calls.clear()
    mx.eval(model(mx.array([[4]]), caches))
    # per layer: q/k/v and gate/up; attention; input, post-attention norms; q and k
    assert calls == {"qmatmuls": 4, "attend": 2, "rms_norm": 5, "rope": 4}
