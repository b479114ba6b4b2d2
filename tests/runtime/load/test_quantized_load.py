"""Weights that stay quantized: the CPU's layout of GGUF blocks (float16 scales where
exact), the min-max re-quantization grid, `--quantize` on float sources
(oracle: the float model with the dequantized weights), refusals, and the weight format
the prefix cache's disk tier keys on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as reference_dequantize
from mlx.utils import tree_flatten

from runtime.backend import on_cpu
from runtime.kernels import quantized_ready
from runtime.kernels.primitives import ENV_ACTIVATIONS
from runtime.load import QuantizeSpec, check_quantize, load
from runtime.load.affine import affine_quantize, float16_exact
from runtime.load.gguf.decode import ConvertedWeights, Plan, Transform, decode_tensor, store
from runtime.load.gguf.quants import FLOAT16_SCALES, to_affine
from runtime.load.gguf.reader import GGUFFile
from runtime.load.precision import Precision
from tests.support.gguf_helpers import TOKENS, our_logits

pytest.importorskip("transformers")

from tests.support.tiny_models import make_tiny, write_tokenizer

_FP16_FIELDS = {QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q5_K: (0, 2), QT.Q4_K: (0, 2), QT.Q6_K: (208,)}
_FP16_FIELDS |= {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q8_0: (0,), QT.Q2_K: (80, 82)}
_FP16_FIELDS |= {QT.Q3_K: (108,)}


def _blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of ``qtype`` with finite, weight-sized float16 block scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype]:
        scales = (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def _dequantized(weight: Any, scales: Any, biases: Any, group: int, bits: int) -> np.ndarray:
    """q * scale + bias in float64 (mx.dequantize rounds through float16 scales' dtype)."""
    ones = mx.ones(scales.shape)
    q = np.array(mx.dequantize(mx.array(weight), ones, mx.zeros(scales.shape), group, bits))
    s = np.repeat(np.asarray(scales, dtype=np.float64), group, axis=-1)
    b = np.repeat(np.asarray(biases, dtype=np.float64), group, axis=-1)
    return q.astype(np.float64) * s + b


# -- GGUF blocks in the CPU's layout -----------------------------------------------------------


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q5_1, QT.Q5_K], ids=str)
def test_five_bit_blocks_stay_five_bit_exactly(qtype: QT) -> None:
    """The 5-bit form dequantizes to the GGUF reference decoder's values (the CPU has an
    int8 kernel for 5 bits too: no widening)."""
    raw = _blocks(qtype, rows=8, cols=512)
    affine = to_affine(raw, int(qtype))
    assert affine is not None and (affine.bits, affine.group_size) == (5, 32)
    got = _dequantized(affine.weight, affine.scales, affine.biases, 32, 5)
    np.testing.assert_allclose(got, reference_dequantize(raw, qtype), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K], ids=str
)
def test_float16_scales_only_where_exact(qtype: QT) -> None:
    """The legacy types' scales and biases are float16 values; the K-quants' products are
    not (they keep float32 on the CPU)."""
    affine = to_affine(_blocks(qtype, rows=8, cols=512), int(qtype))
    assert affine is not None
    assert float16_exact(affine.scales, affine.biases) is (int(qtype) in FLOAT16_SCALES)


def _gguf_with(path: Path, qtype: QT, raw: np.ndarray) -> GGUFFile:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)  # shape: raw's bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.Q3_K, QT.Q2_K], ids=str)
def test_types_without_affine_form_requantize_to_8_bits_on_the_cpu(
    tmp_path: Path, qtype: QT
) -> None:
    """Q6_K/Q3_K/Q2_K on the CPU: 8 bits in groups of 32, float16 scales, every value
    within half a step of the exact one (the grid fits the stored scales)."""
    raw = _blocks(qtype, rows=16, cols=512)
    gf = _gguf_with(tmp_path / "one.gguf", qtype, raw)
    info = gf.tensors["blk.0.ffn_down.weight"]
    cpu = Precision(keep_quantized=True, cpu=True, experts_quantized=False)
    plan = Plan(mx.float32, cpu)
    name = "model.layers.0.mlp.down_proj.weight"
    out = ConvertedWeights()
    store(out, decode_tensor(gf, info, name, Transform(), plan), plan)
    module = "model.layers.0.mlp.down_proj"
    assert out.quantization[module] == {"bits": 8, "group_size": 32}
    scales = out.weights[f"{module}.scales"]
    assert scales.dtype == mx.float16
    s32 = np.array(scales.astype(mx.float32))
    b32 = np.array(out.weights[f"{module}.biases"].astype(mx.float32))
    got = _dequantized(out.weights[name], s32, b32, 32, 8)
    exact = reference_dequantize(raw, qtype).reshape(16, 512)
    step = np.repeat(s32, 32, axis=-1)
    assert np.all(np.abs(got - exact) <= 0.5 * step * (1 + 1e-6) + 1e-9)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_affine_grid_covers_each_group_in_the_stored_dtype(bits: int, dtype: mx.Dtype) -> None:
    """Every value within half a step of its level, with the scales and biases as stored,
    and the packing is MLX's (mx.dequantize reads it back)."""
    w = mx.random.normal((24, 256), key=mx.random.key(3)) * 0.05 + 0.01
    q, scales, biases = affine_quantize(w, group_size=64, bits=bits, scales_dtype=dtype)
    assert scales.dtype == biases.dtype == dtype
    s = np.array(scales.astype(mx.float32))
    got = _dequantized(q, s, np.array(biases.astype(mx.float32)), 64, bits)
    step = np.repeat(s, 64, axis=-1)
    assert np.all(np.abs(got - np.array(w)) <= 0.5 * step * (1 + 1e-6))
    back = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), 64, bits)
    np.testing.assert_allclose(np.array(back), got, rtol=0, atol=1e-6)


# -- loading with the CPU's policy ---------------------------------------------------------------


def _float_gguf(tmp_path: Path, quant: QT | None) -> tuple[Path, Any]:
    from tests.runtime.load.test_loader_gguf import _llama_meta, _tiny_llama
    from tests.support.gguf_helpers import write_gguf

    model = _tiny_llama(llama3_rope=False)
    path = tmp_path / f"tiny-{quant.name if quant else 'f32'}.gguf"
    write_gguf(path, "llama", model, _llama_meta(model.config), quant=quant)
    return path, model


@pytest.mark.skipif(not (on_cpu() and quantized_ready()), reason="the CPU's quantized layout")
@pytest.mark.parametrize("quant", [QT.Q5_0, QT.Q4_0, QT.Q8_0], ids=lambda q: q.name)
def test_quantized_gguf_stays_quantized_on_the_cpu(
    tmp_path: Path, quant: QT, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default the CPU keeps a quantized GGUF quantized: 4-, 5- and 8-bit modules,
    float16 scales, float32 compute; its logits are the float path's (the
    kernel's float32 rows: MLX_GATEWAY_CPU_ACTIVATIONS=float32)."""
    monkeypatch.setenv(ENV_ACTIVATIONS, "float32")
    path, _ = _float_gguf(tmp_path, quant)
    loaded = load(path)
    assert (loaded.quantized, loaded.dtype, loaded.weight_format) == (
        True,
        "float32",
        "gguf-native",
    )
    q_proj = loaded.model.model.layers[0].self_attn.q_proj  # type: ignore[attr-defined]
    bits = {QT.Q4_0: 4, QT.Q5_0: 5}.get(quant, 8)
    assert (type(q_proj).__name__, q_proj.bits, q_proj.group_size) == ("QuantizedLinear", bits, 32)
    assert q_proj.scales.dtype == mx.float16
    floats = load(path, keep_quantized=False)
    np.testing.assert_allclose(
        our_logits(loaded, TOKENS), our_logits(floats, TOKENS), atol=1e-3, rtol=1e-3
    )


# -- --quantize ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model = make_tiny("qwen2", folder)
    write_tokenizer(folder, model.config.vocab_size)
    return folder, model


def _with_dequantized(floats: Any, quantized: Any) -> None:
    """``floats`` (a float model) with each quantized module's dequantized weight."""
    params = dict(tree_flatten(quantized.parameters()))
    new = []
    for name, value in params.items():
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            layer = quantized
            for part in module.split("."):
                layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
            w = _dequantized(
                params[f"{module}.weight"],
                np.array(value.astype(mx.float32)),
                np.array(params[f"{module}.biases"].astype(mx.float32)),
                layer.group_size,
                layer.bits,
            )
            new.append((f"{module}.weight", mx.array(w.astype(np.float32))))
    floats.load_weights(new, strict=False)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_option_quantizes_a_float_folder(
    tiny_folder: tuple[Path, Any], bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every linear layer in groups of 32, embeddings and head at 8 bits; the logits are
    those of the float model holding the dequantized weights (1e-4), and within a stated
    bound of the float model's: max |difference| over the logits' spread (max - min) under
    2% for q8, 20% for q4 (measured on this random model: 0.8% and 12.8%)."""
    monkeypatch.setenv(ENV_ACTIVATIONS, "float32")
    folder, _ = tiny_folder
    spec = QuantizeSpec(bits, 32)
    loaded = load(folder, quantize=spec, keep_quantized=True)
    assert (loaded.quantized, loaded.weight_format) == (True, f"q{bits}g32")
    inner = loaded.model.model  # type: ignore[attr-defined]
    proj = inner.layers[1].mlp.down_proj
    assert (type(proj).__name__, proj.bits, proj.group_size) == ("QuantizedLinear", bits, 32)
    assert (inner.embed_tokens.bits, loaded.model.lm_head.bits) == (8, 8)  # type: ignore[attr-defined]
    floats = load(folder, keep_quantized=False)
    want = our_logits(floats, TOKENS)
    got = our_logits(loaded, TOKENS)
    assert np.abs(got - want).max() / np.ptp(want) < (0.02 if bits == 8 else 0.2)
    _with_dequantized(floats.model, loaded.model)
    np.testing.assert_allclose(got, our_logits(floats, TOKENS), atol=1e-4, rtol=1e-4)


def test_quantize_leaves_widths_the_group_does_not_divide(tiny_folder: tuple[Path, Any]) -> None:
    folder, _ = tiny_folder
    loaded = load(folder, quantize=QuantizeSpec(8, 128), keep_quantized=True)
    layer = loaded.model.model.layers[0]  # type: ignore[attr-defined]
    assert type(layer.mlp.down_proj).__name__ == "QuantizedLinear"  # 128 wide
    assert layer.mlp.up_proj.weight.dtype == mx.float32  # 64 wide


def test_quantize_option_on_a_float_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float GGUF's weights quantized as they are converted: the dequantized-weights
    oracle (1e-4), and within 2% of the logits' spread of the float model (1.1% here)."""
    monkeypatch.setenv(ENV_ACTIVATIONS, "float32")
    path, _ = _float_gguf(tmp_path, None)
    loaded = load(path, quantize=QuantizeSpec(8, 64), keep_quantized=True)
    assert loaded.weight_format == "q8g64"
    q_proj = loaded.model.model.layers[0].self_attn.q_proj  # type: ignore[attr-defined]
    assert (q_proj.bits, q_proj.group_size) == (8, 64)
    floats = load(path, keep_quantized=False)
    want = our_logits(floats, TOKENS)
    _with_dequantized(floats.model, loaded.model)
    np.testing.assert_allclose(
        our_logits(loaded, TOKENS), our_logits(floats, TOKENS), atol=1e-4, rtol=1e-4
    )
    assert np.abs(our_logits(loaded, TOKENS) - want).max() / np.ptp(want) < 0.02


def test_quantize_refuses_quantized_sources(tmp_path: Path, tiny_folder: tuple[Path, Any]) -> None:
    path, _ = _float_gguf(tmp_path, QT.Q8_0)
    spec = QuantizeSpec.parse("q4")
    with pytest.raises(ValueError, match=r"already quantized \(Q8_0 tensors\).*without --quantize"):
        check_quantize(path, spec)
    with pytest.raises(ValueError, match=r"already quantized \(Q8_0 tensors\)"):
        load(path, quantize=spec, keep_quantized=True)
    from tests.runtime.load.test_loader import _quantize_folder

    folder, _ = tiny_folder
    _quantize_folder(folder, tmp_path / "mlx")
    with pytest.raises(ValueError, match=r"already MLX-quantized \(4-bit, group 32\)"):
        check_quantize(tmp_path / "mlx", spec)
    with pytest.raises(ValueError, match="cannot load them dequantized"):
        load(folder, quantize=spec, keep_quantized=False)
    check_quantize(folder, spec)  # a float folder is fine


@pytest.mark.parametrize(
    ("name", "group", "message"),
    [("q5", 64, "use q4 or q8"), ("int4", 64, "use q4 or q8"), ("q4", 16, "use one of 32")],
)
def test_quantize_spec_refuses_what_mlx_cannot_do(name: str, group: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantizeSpec.parse(name, group)


def test_weight_formats_differ(
    tiny_folder: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each way of holding the weights has its own format, and the disk tier's identity
    (runtime/engine/runner.py) differs with it: no cached state crosses a change."""
    from runtime.engine import ModelRunner, RunnerSettings
    from runtime.prefix import DiskTier

    folder, _ = tiny_folder
    path, _ = _float_gguf(tmp_path, QT.Q8_0)
    models = [
        load(folder, keep_quantized=False),
        load(folder, quantize=QuantizeSpec(4, 64), keep_quantized=True),
        load(folder, quantize=QuantizeSpec(8, 64), keep_quantized=True),
        load(path, keep_quantized=True),
        load(path, keep_quantized=False),
    ]
    formats = [m.weight_format for m in models]
    assert formats == ["float32", "q4g64", "q8g64", "gguf-native", "float32"]
    identities: list[str] = []

    def opened(cls: type, directory: Path, *, max_bytes: int, identity: str) -> None:
        identities.append(identity)

    monkeypatch.setattr(DiskTier, "open", classmethod(opened))
    for loaded in models:
        ModelRunner(loaded, RunnerSettings(prefix_cache_dir=tmp_path / "disk")).close()
    assert len(identities) == len(models) and len(set(identities)) == len(models)
