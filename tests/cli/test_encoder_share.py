"""`serve --encoder-share F` ($MLX_GATEWAY_ENCODER_SHARE): the cores' time an encoder gets
while a chat model has work, validated on the command line (above 0, at most 1) and by the
model loader that makes the server's turns from it (1: no turns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.args import build_parser
from gateway.cli.errors import CliError
from gateway.core.models.loader import Loader
from gateway.core.models.served import ServedModel
from gateway.core.models.slots import Slots
from gateway.core.models.spec import ModelSpec
from gateway.core.settings import DEFAULT_ENCODER_SHARE
from runtime.engine.turns import DEFAULT_SHARE


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLX_GATEWAY_ENCODER_SHARE", raising=False)


def test_default_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT_ENCODER_SHARE == DEFAULT_SHARE  # the CLI's copy of the runtime's default
    assert build_parser().parse_args(["serve"]).encoder_share == DEFAULT_SHARE
    assert build_parser().parse_args(["serve", "--encoder-share", "0.5"]).encoder_share == 0.5
    monkeypatch.setenv("MLX_GATEWAY_ENCODER_SHARE", "0.1")
    assert build_parser().parse_args(["serve"]).encoder_share == 0.1
    args = build_parser().parse_args(["serve", "--encoder-share", "1"])  # the flag wins
    assert args.encoder_share == 1.0


@pytest.mark.parametrize("value", ["0", "-0.2", "1.5", "nan", "a quarter"])
def test_bad_values_are_one_line(value: str) -> None:
    with pytest.raises(CliError, match="--encoder-share"):
        build_parser().parse_args(["serve", "--encoder-share", value])


def test_bad_environment_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_GATEWAY_ENCODER_SHARE", "2")
    with pytest.raises(CliError, match="at most 1"):
        build_parser().parse_args(["serve"])


def _never_built() -> ServedModel:
    raise AssertionError("no model is loaded here")


def _loader(**kwargs: float) -> Loader:
    return Loader(Slots([ModelSpec("m", _never_built)]), 1 << 30, **kwargs)


def test_the_loader_makes_its_turns_from_the_share() -> None:
    half = _loader(encoder_share=0.5)
    assert half.turns is not None and half.turns.ratio == pytest.approx(1.0)
    quarter = _loader()
    assert quarter.turns is not None and quarter.turns.ratio == pytest.approx(1 / 3)
    assert _loader(encoder_share=1.0).turns is None
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="above 0 and at most 1"):
            _loader(encoder_share=bad)
