"""`serve --quantize q4|q8 --quantize-group N`: the options, their $MLX_GATEWAY_* defaults,
the per-model config keys, and the startup refusal of an already quantized model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.args import build_parser
from gateway.cli.errors import CliError
from gateway.cli.serve.models import ModelConfig, model_specs, read_config
from gateway.core.settings import EngineSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(tmp_path / "home"))
    for name in ("MLX_GATEWAY_QUANTIZE", "MLX_GATEWAY_QUANTIZE_GROUP"):
        monkeypatch.delenv(name, raising=False)


def test_options_and_their_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.quantize, args.quantize_group) == (None, 64)
    args = build_parser().parse_args(["serve", "--quantize", "q4", "--quantize-group", "32"])
    assert (args.quantize, args.quantize_group) == ("q4", 32)
    assert build_parser().parse_args(["serve", "--quantize", "none"]).quantize is None


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_GATEWAY_QUANTIZE", "Q8")
    monkeypatch.setenv("MLX_GATEWAY_QUANTIZE_GROUP", "128")
    args = build_parser().parse_args(["serve"])
    assert (args.quantize, args.quantize_group) == ("q8", 128)
    args = build_parser().parse_args(["serve", "--quantize", "none"])  # the flag wins
    assert args.quantize is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--quantize", "q5"], "q4, q8 or none"),
        (["--quantize", "int4"], "q4, q8 or none"),
        (["--quantize-group", "48"], "32, 64, 128"),
    ],
)
def test_bad_values_are_one_line(argv: list[str], says: str) -> None:
    with pytest.raises(CliError, match=says):
        build_parser().parse_args(["serve", *argv])


def test_config_keys(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        '[[models]]\nsource = "a"\nquantize = "q4"\nquantize_group = 128\n'
        '[[models]]\nsource = "b"\nquantize = "none"\n'
        '[[models]]\nsource = "c"\n'
    )
    a, b, c = read_config(path)
    assert (a.quantize, a.quantize_group) == ("q4", 128)
    assert (b.quantize, b.quantize_group) == (None, None)
    assert (c.quantize, c.quantize_group) == ("default", None)  # as --quantize says


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('quantize = "q3"', 'quantize must be "q4", "q8" or "none"'),
        ("quantize = 4", 'quantize must be "q4", "q8" or "none"'),
        ("quantize_group = 16", "quantize_group must be one of 32, 64, 128"),
        ("quantize_group = true", "quantize_group must be one of 32, 64, 128"),
    ],
)
def test_bad_config_values(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(f'[[models]]\nsource = "a"\n{line}\n')
    with pytest.raises(CliError, match=says):
        read_config(path)


def _mlx_quantized_folder(tmp_path: Path) -> Path:
    """What the startup check reads of an MLX-quantized folder: its config."""
    folder = tmp_path / "q4-model"
    folder.mkdir()
    config = {"model_type": "llama", "quantization": {"bits": 4, "group_size": 64}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_quantized_model_is_refused_at_startup(tmp_path: Path) -> None:
    folder = _mlx_quantized_folder(tmp_path)
    settings = EngineSettings(quantize="q4")
    with pytest.raises(CliError, match=r"already MLX-quantized \(4-bit, group 64\)"):
        model_specs([ModelConfig(str(folder))], settings, budget=1 << 30)
    # a model's own quantize = "none" takes it out of the global --quantize
    (spec,) = model_specs([ModelConfig(str(folder), quantize=None)], settings, budget=1 << 30)
    assert spec.source == str(folder)
    # and a model's own quantize applies without the global one
    with pytest.raises(CliError, match="already MLX-quantized"):
        model_specs([ModelConfig(str(folder), quantize="q8")], EngineSettings(), budget=1 << 30)


def test_the_memory_estimate_counts_quantized_bytes(tmp_path: Path) -> None:
    """Before its first load a --quantize model counts as its 16-bit files at 4 bits plus
    a float16 scale and bias per 64 weights (4.5 bits), not as the files' size."""
    folder = tmp_path / "bf16-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 16_000)
    (plain,) = model_specs([ModelConfig(str(folder))], EngineSettings(), budget=1 << 30)
    q4 = EngineSettings(quantize="q4")
    (quantized,) = model_specs([ModelConfig(str(folder))], q4, budget=1 << 30)
    assert (plain.weight_bytes, quantized.weight_bytes) == (16_000, 4_500)


def test_settings_refuse_unknown_values() -> None:
    with pytest.raises(ValueError, match="quantize must be one of"):
        EngineSettings(quantize="q5")
    with pytest.raises(ValueError, match="quantize_group must be one of"):
        EngineSettings(quantize_group=48)
