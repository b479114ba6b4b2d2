"""Qwen3.5 vision checkpoints, dense and MoE: the layouts they come in (transformers',
the older top-level ``visual.``, MLX converters'; the MoE's experts per expert, fused as
Qwen publishes them, or stacked) load alike; an MLX-quantized MoE folder keeps its vision
tower; and text-only checkpoints (a conversion without vision weights, a flat
`qwen3_5_moe_text` config, a multimodal checkpoint under a config without its
vision_config) load the text model, as before the MoE had vision."""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.load.loader import load  # noqa: E402
from runtime.vision.spans import PromptImages, grid_of  # noqa: E402
from tests.support.model_checks import TinyModels, assert_matches_transformers, forward  # noqa: E402
from tests.support.tiny_hybrid import _MOE, _randomize  # noqa: E402
from tests.support.tiny_models import (  # noqa: E402
    load_mlx,
    quantize_weight,
    save_quantized,
    save_tiny,
)
from tests.support.tiny_qwen_vision import (  # noqa: E402
    DENSE,
    MOE,
    TEXT_CONFIG,
    make,
    pixels,
    prefill,
    prompt,
    vision_model,
    write_preprocessor_config,
    write_tokenizer,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make)


def _weights(directory: Path) -> dict[str, mx.array]:
    weights = mx.load(str(directory / "model.safetensors"))
    assert isinstance(weights, dict)
    return weights


_EXPERT = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def _mlx_layout(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' names -> MLX converters' (vision_tower.*, language_model.model.*),
    the patch convolution's weight channels-last, each MoE block's experts stacked
    (``switch_mlp.<proj>``, (experts, out, in)) as mlx-vlm writes them."""
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = defaultdict(dict)
    for name, value in weights.items():
        if name.startswith("model.visual."):
            if name.endswith("patch_embed.proj.weight"):
                value = value.transpose(0, 2, 3, 4, 1)
            out["vision_tower." + name.removeprefix("model.visual.")] = value
            continue
        if name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        else:
            name = "language_model." + name
        match = _EXPERT.match(name)
        if match is None:
            out[name] = value
        else:
            stacked = f"{match['block']}.switch_mlp.{match['proj']}.weight"
            experts[stacked][int(match["expert"])] = value
    out.update({k: mx.stack([v[e] for e in sorted(v)]) for k, v in experts.items()})
    return out


def _layout(name: str, weights: dict[str, mx.array], hf: Any) -> dict[str, mx.array]:
    if name == "mlx":
        return _mlx_layout(weights)
    if name == "visual":  # the older top-level visual.*
        return {
            k.removeprefix("model.") if k.startswith("model.visual.") else k: v
            for k, v in weights.items()
        }
    # Qwen's published MoE checkpoints: transformers' in-memory names, every block's
    # experts fused (gate_up_proj (experts, 2 * moe hidden, dims), down_proj)
    fused = {k: mx.array(v.numpy()) for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    return fused


@pytest.mark.parametrize(
    ("kind", "layout"),
    [(DENSE, "mlx"), (DENSE, "visual"), (MOE, "mlx"), (MOE, "visual"), (MOE, "fused")],
)
def test_checkpoint_layouts_load_alike(
    kind: str, layout: str, tiny: TinyModels, tmp_path: Path
) -> None:
    hf, reference = vision_model(tiny, kind)
    directory = tiny[kind][1]
    weights = _weights(directory)
    renamed = _layout(layout, weights, hf)
    assert renamed.keys() != weights.keys()
    mx.save_safetensors(str(tmp_path / "model.safetensors"), renamed)
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    model: Any = load_mlx(tmp_path)
    picture = mx.array(pixels(11, 16, 24)[None])
    np.testing.assert_array_equal(
        np.array(model.encode_images(picture)), np.array(reference.encode_images(picture))
    )
    tokens = mx.array([[5, 6, 7]])
    np.testing.assert_array_equal(
        np.array(model(tokens, model.make_caches())),
        np.array(reference(tokens, reference.make_caches())),
    )


def _copy_folder(directory: Path, to: Path, weights: dict[str, mx.array]) -> None:
    mx.save_safetensors(str(to / "model.safetensors"), weights)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (to / name).write_text((directory / name).read_text())


@pytest.mark.parametrize("kind", [DENSE, MOE])
def test_checkpoint_without_vision_weights_loads_the_text_model(
    kind: str, tiny: TinyModels, tmp_path: Path
) -> None:
    """A text-only conversion (mlx-lm's: the multimodal config, no vision weights)."""
    _, reference = vision_model(tiny, kind)
    directory = tiny[kind][1]
    weights = _weights(directory)
    _copy_folder(directory, tmp_path, {k: v for k, v in weights.items() if "visual" not in k})
    loaded = load(tmp_path, dtype="float32")
    assert grid_of(loaded.model) is None and loaded.vision is None
    tokens = np.array([[5, 6, 7, 8]])
    np.testing.assert_allclose(
        forward(loaded.model, tokens, loaded.model.make_caches()),
        forward(reference, tokens, reference.make_caches()),
        atol=1e-6,
        rtol=0,
    )
    assert load(directory).vision is not None


def _moe_text() -> Any:
    config = transformers.Qwen3_5MoeTextConfig(**{**TEXT_CONFIG, **_MOE})
    return transformers.Qwen3_5MoeForCausalLM(config)


def test_text_only_moe_configs_load_the_text_model(
    tiny: TinyModels, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A flat `qwen3_5_moe_text` checkpoint (transformers' Qwen3_5MoeForCausalLM) matches
    transformers; a multimodal MoE checkpoint under a config without its vision_config
    serves the text model, its vision weights skipped in one log line."""
    tokens = np.random.default_rng(4).integers(0, 990, (1, 40))
    flat = tmp_path / "flat"
    hf_text = save_tiny((_moe_text, None), flat, 1, _randomize)
    assert json.loads((flat / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    assert_matches_transformers(hf_text, flat, tokens, ATOL)

    hf, directory = tiny[MOE]
    weights = _weights(directory)
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    _copy_folder(directory, stripped, weights)
    config = json.loads((directory / "config.json").read_text())
    del config["vision_config"]
    (stripped / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="runtime.models.qwen3_5"):
        loaded = load(stripped, dtype="float32")
    assert grid_of(loaded.model) is None and loaded.vision is None
    assert len([r for r in caplog.records if "vision weights" in r.getMessage()]) == 1
    with torch.no_grad():
        expected = hf(input_ids=torch.from_numpy(tokens)).logits.numpy()
    got = forward(loaded.model, tokens, loaded.model.make_caches())
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def _quantized_mlx_folder(src: Path, model: Any, dst: Path) -> None:
    """An mlx-community style copy of a vision folder: sanitized weights under
    ``language_model.`` and ``vision_tower.`` (the patch convolution channels-last, as a
    Conv3d's, unquantized), every other linear layer, embedding table and expert stack
    4-bit in groups of 32 (as legacy mlx-vlm conversions quantized the tower too), the
    routers 8-bit with their overrides keyed by those names."""
    raw = _weights(src)
    out: dict[str, mx.array] = {}
    overrides: dict[str, Any] = {}
    for name, value in model.sanitize(dict(raw)).items():
        if name.startswith("visual."):
            full = "vision_tower." + name.removeprefix("visual.")
        else:
            full = "language_model." + name
        if name == "visual.patch_embed.proj.weight":
            out[full] = raw["model." + name].transpose(0, 2, 3, 4, 1)
        elif name.endswith(".weight") and value.ndim in (2, 3) and value.shape[-1] % 32 == 0:
            quantize_weight(out, overrides, full, value)
        else:
            out[full] = value
    save_quantized(src, dst, out, overrides)
    write_tokenizer(dst)
    write_preprocessor_config(dst)


def test_quantized_moe_folder_keeps_its_vision_tower(tiny: TinyModels, tmp_path: Path) -> None:
    """Kept quantized (the tower's layers and position table too) or dequantized, the
    folder reads images alike; routers keep their 8 bits."""
    _, model = vision_model(tiny, MOE)
    _quantized_mlx_folder(tiny[MOE][1], model, tmp_path / "q")
    kept = load(tmp_path / "q", dtype="float32", keep_quantized=True)
    dequantized = load(tmp_path / "q", dtype="float32", keep_quantized=False)
    assert kept.quantized and not dequantized.quantized
    assert kept.vision is not None and dequantized.vision is not None
    ours: Any = kept.model
    assert ours.visual.blocks[0].attn.qkv.bits == ours.visual.pos_embed.bits == 4
    assert ours.model.layers[0].mlp.gate.bits == 8
    tokens, images = prompt([pixels(14, 16, 40)], [[5, 17, 40], [9, 8, 7]])
    models: list[Any] = [kept.model, dequantized.model]
    logits = [prefill(m, PromptImages(m, images, tokens), tokens, 5)[0] for m in models]
    np.testing.assert_allclose(logits[0], logits[1], atol=ATOL, rtol=0)
