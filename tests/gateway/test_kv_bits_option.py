"""`--kv-bits` as the other engine settings come: the command line, $MLX_GATEWAY_KV_BITS,
and a config file's per-model `kv_bits`, down to the runner's caches."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from gateway.cli.args import build_parser
from gateway.cli.common import engine_settings
from gateway.cli.errors import CliError
from gateway.cli.serve.command import model_registry
from gateway.cli.serve.models import read_config
from runtime.cache import KVCache, QuantizedKVCache
from tests.support.engine_kinds import folder_maker


@pytest.mark.parametrize(
    ("argv", "env", "want"),
    [
        ([], None, None),
        (["--kv-bits", "8"], None, 8),
        (["--kv-bits", "4"], None, 4),
        ([], "8", 8),
        (["--kv-bits", "none"], "4", None),  # the flag over the environment
        ([], "none", None),
    ],
)
def test_the_flag_and_the_environment_reach_the_engine_settings(
    argv: list[str], env: str | None, want: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is not None:
        monkeypatch.setenv("MLX_GATEWAY_KV_BITS", env)
    for command in ("serve", "run"):
        args = build_parser().parse_args([command, *argv])
        assert engine_settings(args).kv_bits == want


@pytest.mark.parametrize(("argv", "env"), [(["--kv-bits", "16"], None), ([], "3")])
def test_other_widths_are_a_usage_error(
    argv: list[str], env: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is not None:
        monkeypatch.setenv("MLX_GATEWAY_KV_BITS", env)
    with pytest.raises(CliError, match="8, 4 or none"):
        build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("line", "says"),
    [("kv_bits = 3", "kv_bits must be"), ("kv_bits = true", "kv_bits must be")],
)
def test_config_mistakes(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"[[models]]\nsource = 'm'\n{line}\n")
    with pytest.raises(CliError, match=says):
        read_config(path)


def test_each_model_takes_its_own_or_the_servers_kv_bits(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    folder = folder_maker(tmp_path_factory)("llama")
    path = tmp_path / "models.toml"
    path.write_text(
        f'[[models]]\nsource = "{folder}"\nid = "own"\nkv_bits = 4\n'
        f'[[models]]\nsource = "{folder}"\nid = "lossless"\nkv_bits = "none"\n'
        f'[[models]]\nsource = "{folder}"\nid = "server"\n'
    )
    args = build_parser().parse_args(["serve", "--config", str(path), "--kv-bits", "8"])
    registry = model_registry(args, engine_settings(args))
    want = {"own": 4, "lossless": None, "server": 8}
    for spec in registry.specs:
        served = spec.build()
        try:
            runner = served.runner
            assert runner is not None and runner.settings.kv_bits == want[spec.id]
            caches = runner.make_caches()
            kind = KVCache if want[spec.id] is None else QuantizedKVCache
            assert all(type(c) is kind for c in caches)
            assert all(getattr(c, "bits", want[spec.id]) == want[spec.id] for c in caches)
        finally:
            served.engine.stop()
