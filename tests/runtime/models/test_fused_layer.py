"""A decoder layer's step as one primitive (runtime/models/fused_layer.py) gives the bits
of its separate primitives: tiny quantized models of every llama-style variant (biases,
llama3 and yarn rope, q/k norms, tied heads, symmetric groups without biases), a running
batch of rows of different lengths, decode steps, a verify step of several tokens a row
and its rewind, on every activation path; layers it does not fit (gemma's extra norms)
run their modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from mlx.nn.layers.quantized import quantize

from runtime import kernels as cpu_kernels
from runtime.cache import BatchCaches
from runtime.kernels import lanes, primitives
from runtime.models import decoder, fused_layer
from runtime.models.linear import QuantizedLinear, drop_symmetric_biases, use_lanes
from tests.support.tiny_models import load_mlx, make_tiny

FUSED = ["llama", "llama_bias_tied", "llama3_rope", "qwen2", "qwen3", "qwen2_yarn"]


@pytest.fixture(autouse=True)
def _cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if primitives.extension() is None:
        if primitives.expected():
            pytest.fail("the MLX extension did not load (pip install -e . builds it)")
        pytest.skip("no MLX extension on this platform")
    for name in (primitives.ENV_LAYER, primitives.ENV_ACTIVATIONS, cpu_kernels.ENV_ISA):
        monkeypatch.delenv(name, raising=False)
    with mx.stream(mx.cpu):
        yield


def _quantized(name: str, folder: Path) -> Any:
    """The tiny model with 4-bit products; every other layer's groups made symmetric and
    kept without biases (GGUF's Q4_0 on the CPU)."""
    make_tiny(name, folder, seed=5)
    model: Any = load_mlx(folder)
    quantize(model, group_size=32, bits=4)
    for i, layer in enumerate(model.model.layers):
        if i % 2 == 0:
            continue
        for _, module in layer.named_modules():
            if isinstance(module, QuantizedLinear):
                module.update({"biases": cpu_kernels.symmetric_biases(module["scales"], 4)})
    mx.eval(model.parameters())
    assert drop_symmetric_biases(model) > 0
    return model


@pytest.fixture(scope="module", params=FUSED)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _quantized(request.param, tmp_path_factory.mktemp(request.param))


def _tokens(vocab: int, rows: int, length: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(3, vocab, size=(rows, length)).astype(np.int32))


def _batch(model: Any, lengths: list[int]) -> BatchCaches:
    batch = BatchCaches(model.make_caches(), rows=True)
    for i, n in enumerate(lengths):
        caches = model.make_caches()
        model.forward(_tokens(model.args.vocab_size, 1, n, 30 + i), caches)
        mx.eval([a for c in caches for a in c.state])
        batch.add(caches)
    return batch


def _steps(model: Any, monkeypatch: pytest.MonkeyPatch, fused: bool) -> list[np.ndarray[Any, Any]]:
    """Logits of decode steps, a 4-token verify step, a rewind and one more step."""
    monkeypatch.setenv(primitives.ENV_LAYER, "1" if fused else "0")
    batch = _batch(model, [40, 7, 300])  # 300: past a growth step of the rows
    vocab, out = model.args.vocab_size, []

    def step(tokens: mx.array) -> None:
        logits = model.logits(model.forward(tokens, batch.layers))
        mx.eval(logits, [a for layer in batch.layers for a in layer.state])
        out.append(np.array(logits))

    for i in range(3):
        step(_tokens(vocab, 3, 1, 50 + i))
    step(_tokens(vocab, 3, 4, 60))
    batch.rewind(2)
    step(_tokens(vocab, 3, 1, 61))
    return out


@pytest.fixture
def count(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many layer steps ran as the one primitive."""
    calls = [0]
    real = fused_layer.layer_step

    def counted(layer: Any, x: mx.array, cache: object) -> mx.array | None:
        out = real(layer, x, cache)
        calls[0] += out is not None
        return out

    monkeypatch.setattr(decoder, "layer_step", counted)
    return calls


def test_the_one_primitive_gives_the_bits_of_the_separate_ones(
    model: Any, monkeypatch: pytest.MonkeyPatch, count: list[int]
) -> None:
    separate = _steps(model, monkeypatch, fused=False)
    assert count[0] == 0
    fused = _steps(model, monkeypatch, fused=True)
    assert count[0] == 5 * len(model.model.layers)  # every step of every layer
    for a, b in zip(separate, fused, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("isa", "activations"), [("avx2", "int16"), ("", "int8"), ("", "float32"), ("generic", "int16")]
)
def test_every_activation_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: list[int], isa: str, activations: str
) -> None:
    model = _quantized("qwen3", tmp_path)
    if isa:
        monkeypatch.setenv(cpu_kernels.ENV_ISA, isa)
    monkeypatch.setenv(primitives.ENV_ACTIVATIONS, activations)
    separate = _steps(model, monkeypatch, fused=False)
    fused = _steps(model, monkeypatch, fused=True)
    assert count[0] > 0
    for a, b in zip(separate, fused, strict=True):
        np.testing.assert_array_equal(a, b)


def test_layers_it_does_not_fit_run_their_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: list[int]
) -> None:
    model = _quantized("gemma3_text", tmp_path)
    _steps(model, monkeypatch, fused=True)
    assert count[0] == 0


def test_a_float_model_runs_its_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: list[int]
) -> None:
    make_tiny("llama", tmp_path, seed=5)
    _steps(load_mlx(tmp_path), monkeypatch, fused=True)
    assert count[0] == 0


@pytest.mark.parametrize("name", ["qwen3", "llama_bias_tied"])
def test_weights_in_lanes_give_the_bits_of_the_separate_primitives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: list[int], name: str
) -> None:
    """The layer primitive and the separate ones both read 16-feature lanes
    (runtime/kernels/lanes.py); what they give stays close to the standard layout's."""
    model = _quantized(name, tmp_path)
    standard = _steps(model, monkeypatch, fused=True)
    moved = use_lanes(model)
    if not cpu_kernels.lanes_ready():
        pytest.skip("weights stay standard here")
    assert moved > 0 and lanes.in_lanes(model.model.layers[0].mlp.down_proj["weight"])
    fused = _steps(model, monkeypatch, fused=True)
    assert count[0] > 0
    separate = _steps(model, monkeypatch, fused=False)
    for a, b, c in zip(separate, fused, standard, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(b, c, rtol=1e-3, atol=2e-3)
