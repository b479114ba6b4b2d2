"""FP8 block-scaled checkpoints (quantization_config quant_method "fp8": DeepSeek-V3/R1,
Qwen3-*-FP8), written from tiny random transformers models by tests/support/tiny_fp8.py with
torch's float8_e4m3fn (hidden 160, intermediate 320: partial 128-blocks on both axes):
loaded, their logits equal transformers' float32 model with the dequantized weights
(fp8 value x block scale) to 1e-4 over a prefill and decode steps, and the weights are
the fp8-rounded ones, not the originals; kept quantized they become MLX 8-bit; what
runtime/load/fp8.py cannot load is a ValueError naming the field or tensor."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from mlx.nn.layers.quantized import QuantizedLinear
from mlx.utils import tree_flatten

from runtime.load.loader import load
from runtime.models.moe import QuantizedSwitchLinear
from tests.support.gguf_helpers import TOKENS
from tests.support.model_checks import TinyModels, chunked
from tests.support.tiny_deepseek import _YARN, _deepseek, add_mtp_layer
from tests.support.tiny_fp8 import Fp8Case, oracle, rewrite, write_fp8
from tests.support.tiny_models import _llama, randomize, save_tiny, torch_logits

ATOL = 1e-4
PREFILL = 12  # then the rest of TOKENS one decode step at a time
_LLAMA = (lambda: _llama(hidden_size=160, intermediate_size=320, head_dim=40), None)

CASES: dict[str, Fp8Case] = {
    # bfloat16 scales (Qwen3-FP8's); the head and one projection left in bfloat16
    "llama": Fp8Case(
        _LLAMA,
        scale_dtype=torch.bfloat16,
        not_converted=("lm_head", "model.layers.1.mlp.down_proj"),
    ),
    # DeepSeek-V3: MLA, fp8 experts stored per expert, float32 scales, an MTP layer
    "deepseek_v3": Fp8Case((lambda: _deepseek(hidden_size=160, rope_parameters=dict(_YARN)), None)),
    # scale_fmt "ue8m0" (DeepSeek-V3.1's): power-of-two scales stored as F8_E8M0
    "llama_ue8m0": Fp8Case(_LLAMA, scale_dtype=torch.float8_e8m0fnu),
    # weight_block_size null: one scale per tensor
    "llama_per_tensor": Fp8Case(_LLAMA, block=None),
}


def _make(name: str, directory: Path) -> Any:
    """(original model, {name: (original, dequantized)}, oracle model)."""
    case = CASES[name]
    base = directory / "base"
    original = save_tiny(case.variant, base, 0, partial(randomize, bias_scale=0.05))
    if name.startswith("deepseek"):
        add_mtp_layer(base, original.config.num_hidden_layers)
    rounded = write_fp8(case, base, directory / "fp8", directory / "oracle")
    return original, rounded, oracle(directory / "oracle")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """name -> ((original, rounded weights, oracle), folder holding fp8/ and oracle/)."""
    return TinyModels(tmp_path_factory, _make)


def _params(loaded: Any) -> dict[str, mx.array]:
    return dict(tree_flatten(loaded.model.parameters()))


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_checkpoint_matches_transformers(written: TinyModels, name: str) -> None:
    (original, _, want_model), directory = written[name]
    loaded = load(directory / "fp8", keep_quantized=False)
    assert (loaded.quantized, loaded.dtype) == (False, "float32")
    assert len(loaded.model.make_caches()) == want_model.config.num_hidden_layers  # no MTP
    want = torch_logits(want_model, TOKENS)
    np.testing.assert_allclose(chunked(loaded.model, TOKENS, [PREFILL, 1]), want, atol=ATOL)
    # the fp8 rounding shows in the logits: the originals would not pass the check above
    assert not np.allclose(torch_logits(original, TOKENS), want, atol=10 * ATOL)


def test_weights_are_the_fp8_rounded_values(written: TinyModels) -> None:
    """Each fp8 weight is value x scale exactly (not the original it was rounded from);
    modules left unconverted are their bfloat16 originals."""
    (_, rounded, _), directory = written["llama"]
    params = _params(load(directory / "fp8", keep_quantized=False))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
        before, after = (t.numpy() for t in rounded[name])
        assert np.array_equal(np.array(params[name]), after), name
        assert not np.allclose(np.array(params[name]), before, atol=1e-4), name
    assert "model.layers.1.mlp.down_proj.weight" not in rounded
    assert params["lm_head.weight"].dtype == mx.float32

    (_, rounded, _), directory = written["deepseek_v3"]
    params = _params(load(directory / "fp8", keep_quantized=False))
    stacked = np.array(params["model.layers.1.mlp.switch_mlp.gate_proj.weight"])
    before, after = (t.numpy() for t in rounded["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert np.array_equal(stacked[5], after)
    assert not np.allclose(stacked[5], before, atol=1e-4)


def test_bfloat16_weights_are_the_products_rounded_once(written: TinyModels) -> None:
    (_, rounded, _), directory = written["llama"]
    params = _params(load(directory / "fp8", dtype="bfloat16", keep_quantized=False))
    name = "model.layers.0.mlp.up_proj.weight"
    assert params[name].dtype == mx.bfloat16
    want = mx.array(rounded[name][1].numpy()).astype(mx.bfloat16)
    assert mx.array_equal(params[name], want).item()


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_kept_quantized_is_mlx_8_bit(written: TinyModels, name: str) -> None:
    """Kept quantized (the accelerators' default), the fp8 matrices become 8-bit affine
    in groups of 32 (160 is no multiple of 64), fit to the fp8 products; bfloat16
    modules and routers stay float. Its rounding moves the logits several times less
    than the fp8 rounding did (a median; a near-tie in deepseek's routing may flip)."""
    (original, rounded, want_model), directory = written[name]
    kept = load(directory / "fp8", keep_quantized=True, dtype="float32")
    assert kept.quantized is True
    layers = kept.model.model.layers  # type: ignore[attr-defined]
    proj = "q_a_proj" if name == "deepseek_v3" else "q_proj"
    q_proj = getattr(layers[0].self_attn, proj)
    assert isinstance(q_proj, QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (8, 32)
    values = mx.dequantize(q_proj.weight, q_proj.scales, q_proj.biases, 32, 8)
    before, after = (t.numpy() for t in rounded[f"model.layers.0.self_attn.{proj}.weight"])
    step = np.abs(np.repeat(np.array(q_proj.scales), 32, axis=-1))  # an 8-bit step
    assert np.all(np.abs(np.array(values) - after) <= step * (1 + 1e-5))
    assert np.abs(np.array(values) - after).mean() < 0.25 * np.abs(before - after).mean()
    assert kept.model.lm_head.weight.dtype == mx.float32  # type: ignore[attr-defined]
    if name == "deepseek_v3":
        experts = layers[1].mlp.switch_mlp.down_proj
        assert isinstance(experts, QuantizedSwitchLinear) and experts.bits == 8
        assert layers[1].mlp.gate.weight.dtype == mx.float32
    else:
        assert layers[1].mlp.down_proj.weight.dtype == mx.float32  # left unconverted
    want = torch_logits(want_model, TOKENS)
    ours = chunked(kept.model, TOKENS, [PREFILL, 1])
    fp8_moved = np.median(np.abs(torch_logits(original, TOKENS) - want))
    assert np.median(np.abs(ours - want)) < 0.3 * fp8_moved


# -- what cannot load ------------------------------------------------------------------------

Edit = Callable[[dict[str, Any]], None]
_Q = "model.layers.0.self_attn.q_proj.weight"


def _set(key: str, value: Any) -> Edit:
    return lambda quant: quant.__setitem__(key, value)


_CONFIGS: list[tuple[str, Edit, str]] = [
    ("e5m2", _set("fmt", "e5m2"), r"quantization_config\.fmt is 'e5m2'"),
    ("static", _set("activation_scheme", "static"), r"quantization_config\.activation_scheme"),
    ("one_size", _set("weight_block_size", [128]), r"quantization_config\.weight_block_size"),
    ("zero", _set("weight_block_size", [0, 128]), r"quantization_config\.weight_block_size"),
    ("float", _set("weight_block_size", [128.0, 128]), r"quantization_config\.weight_block_size"),
    # the scales were written for 128 x 128 blocks
    ("grid", _set("weight_block_size", [64, 128]), r"_scale_inv: shape .* \[64, 128\] blocks"),
    ("per_tensor", _set("weight_block_size", None), r"weight_block_size is not set"),
]


@pytest.mark.parametrize(("edit", "error"), [c[1:] for c in _CONFIGS], ids=[c[0] for c in _CONFIGS])
def test_unsupported_config_is_an_error_naming_it(
    written: TinyModels, tmp_path: Path, edit: Edit, error: str
) -> None:
    _, directory = written["llama"]
    with pytest.raises(ValueError, match=error):
        load(rewrite(directory / "fp8", tmp_path / "bad", config=edit))


def _drop_scale(tensors: dict[str, Any]) -> None:
    del tensors[_Q + "_scale_inv"]


def _e5m2(tensors: dict[str, Any]) -> None:
    tensors[_Q] = tensors[_Q].float().to(torch.float8_e5m2)


def _input_scale(tensors: dict[str, Any]) -> None:
    tensors["model.layers.0.self_attn.q_proj.input_scale"] = torch.ones(())


def _stray_scale(tensors: dict[str, Any]) -> None:
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 3)


_TENSORS: list[tuple[str, Edit, str]] = [
    ("no_scale", _drop_scale, re.escape(f"{_Q} is F8_E4M3 but the checkpoint has no {_Q}_scale")),
    ("e5m2", _e5m2, re.escape(f"tensor {_Q} is F8_E5M2")),
    ("input_scale", _input_scale, r"q_proj\.input_scale: static activation scales"),
    ("stray_scale", _stray_scale, r"down_proj\.weight_scale_inv: a scale for .* not F8_E4M3"),
]


@pytest.mark.parametrize(("edit", "error"), [c[1:] for c in _TENSORS], ids=[c[0] for c in _TENSORS])
def test_unloadable_tensor_is_an_error_naming_it(
    written: TinyModels, tmp_path: Path, edit: Edit, error: str
) -> None:
    _, directory = written["llama"]
    with pytest.raises(ValueError, match=error):
        load(rewrite(directory / "fp8", tmp_path / "bad", tensors=edit))
