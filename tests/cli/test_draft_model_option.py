"""`serve --draft-model M` / `--speculative draft`: the options, their $MLX_GATEWAY_*
defaults, the per-model config key, the startup refusal of a draft whose tokenizer is
not the served model's, and the draft's weights in the memory budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.args import build_parser
from gateway.cli.common import engine_settings
from gateway.cli.errors import CliError
from gateway.cli.serve.models import ModelConfig, model_specs, read_config
from gateway.core.settings import EngineSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(tmp_path / "home"))
    for name in ("MLX_GATEWAY_SPECULATIVE", "MLX_GATEWAY_DRAFT_MODEL"):
        monkeypatch.delenv(name, raising=False)


def _folder(root: Path, name: str, words: int, weight_bytes: int = 1000) -> Path:
    """What the startup check reads of a model: config, weights' size, tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"\0" * weight_bytes)
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    return folder


def _settings(*argv: str) -> EngineSettings:
    return engine_settings(build_parser().parse_args(["serve", *argv]))


def test_options_their_defaults_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    draft = _folder(tmp_path, "draft", 64)
    plain = _settings()
    assert (plain.speculative, plain.draft_model) == ("lookup", None)
    given = _settings("--draft-model", str(draft))  # a draft model drafts
    assert (given.speculative, given.draft_model) == ("draft", draft)
    assert _settings("--speculative", "draft", "--draft-model", str(draft)).draft_model == draft
    assert _settings("--speculative", "trie").speculative == "trie"
    monkeypatch.setenv("MLX_GATEWAY_DRAFT_MODEL", str(draft))
    assert _settings().draft_model == draft
    monkeypatch.setenv("MLX_GATEWAY_SPECULATIVE", "draft")
    assert _settings().speculative == "draft"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--speculative", "draft"], "needs a draft model: --draft-model MODEL"),
        (["--speculative", "lookup", "--draft-model", "DRAFT"], "not lookup"),
    ],
)
def test_contradictions_are_one_line(tmp_path: Path, argv: list[str], says: str) -> None:
    draft = _folder(tmp_path, "draft", 64)
    with pytest.raises(CliError, match=says):
        _settings(*[str(draft) if a == "DRAFT" else a for a in argv])


def test_config_key(tmp_path: Path) -> None:
    _folder(tmp_path, "small", 64)
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nsource = "a"\ndraft_model = "small"\n[[models]]\nsource = "b"\n')
    a, b = read_config(path)
    assert a.draft_model == str((tmp_path / "small").resolve())  # beside the file
    assert b.draft_model is None
    path.write_text('[[models]]\nsource = "a"\ndraft_model = 3\n')
    with pytest.raises(CliError, match="draft_model must be a non-empty string"):
        read_config(path)


def test_a_draft_with_another_tokenizer_is_refused_at_startup(tmp_path: Path) -> None:
    target = _folder(tmp_path, "target", 64, weight_bytes=5000)
    same = _folder(tmp_path, "same", 64, weight_bytes=700)
    other = _folder(tmp_path, "other", 60)
    settings = EngineSettings(speculative="draft", draft_model=other)
    with pytest.raises(
        CliError,
        match="tokenizer is not the target's: 4 tokens differ \\(the target has 64, the draft 60",
    ):
        model_specs([ModelConfig(str(target))], settings, budget=1 << 30)
    with pytest.raises(CliError, match="tokenizer is not the target's"):  # the config's key
        model_specs([ModelConfig(str(target), draft_model=str(other))], EngineSettings(), 1 << 30)
    # the same tokenizer: the draft's files count in the model's memory estimate
    (spec,) = model_specs(
        [ModelConfig(str(target), draft_model=str(same))], EngineSettings(), budget=1 << 30
    )
    assert spec.weight_bytes == 5700
    two = [ModelConfig(str(target)), ModelConfig(str(same))]
    with pytest.raises(CliError, match="drafts for one model"):
        model_specs(two, EngineSettings(speculative="draft", draft_model=same), budget=1 << 30)


def test_settings_pair_the_mode_with_a_draft(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speculative 'draft'"):
        EngineSettings(speculative="draft")
    with pytest.raises(ValueError, match="speculative 'draft'"):
        EngineSettings(speculative="lookup", draft_model=tmp_path)
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineSettings(speculative="medusa")


def test_the_draft_s_weights_count_in_the_budget(tmp_path: Path) -> None:
    """A loaded model with a draft counts both models' weights (the registry's budget)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import tests.support.tiny_models as tiny_models
    from gateway.core.models import build_served, parameter_bytes
    from gateway.core.models.memory import served_bytes

    target, draft = tmp_path / "t", tmp_path / "d"
    for folder, seed in ((target, 3), (draft, 4)):
        folder.mkdir()
        tiny_models.make_tiny("llama", folder, seed=seed)
        tiny_models.write_tokenizer(folder, tiny_models.VOCAB)
    cache = 300 * 1024**2
    settings = EngineSettings(cache_memory_bytes=cache, speculative="draft", draft_model=draft)
    served = build_served(target, model_id="t", settings=settings)
    weights = parameter_bytes(served.loaded.model)
    assert weights is not None and served.runner is not None
    assert served.runner.draft is not None
    assert served_bytes(served) == 2 * weights + cache  # the same architecture twice
    alone = build_served(target, model_id="t", settings=EngineSettings(cache_memory_bytes=cache))
    assert served_bytes(alone) == weights + cache
