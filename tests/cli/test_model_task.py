"""The per-model `task` config key: a Qwen3-Reranker causal LM whose folder name does
not say "reranker" served as a reranker (its scores the model card's yes/no formula,
computed with transformers), a folder named "...reranker" kept a chat model, what
/v1/models cards report before a load, and the startup errors for a task the files
contradict."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from gateway.cli.errors import CliError
from gateway.cli.serve.models import model_specs, read_config
from gateway.core.settings import EngineSettings
from runtime.load import EncoderTask, LoadedEncoder, encoder_task, is_encoder
from runtime.load.decoder_encoder import RERANKER_PROMPT
from tests.runtime.models.test_decoder_encoders import (
    _documents,
    _ours,
    _reference_inputs,
    _yes_no_scores,
)
from tests.support.tiny_decoder_encoders import save_embedder, save_reranker
from tests.support.tiny_encoders import save_encoder

BUDGET = 1 << 30


@pytest.fixture(autouse=True)
def _home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(tmp_path / "home"))


def _config(root: Path, source: Path, task: object) -> Path:
    file = root / "models.toml"
    value = f'"{task}"' if isinstance(task, str) else str(task)
    file.write_text(f'[[models]]\nsource = "{source}"\ntask = {value}\n')
    return file


def test_task_rerank_serves_a_causal_lm_whose_name_does_not_say_so(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-qwen3-chat"
    model = save_reranker(folder, "causal", seed=7)
    assert not is_encoder(folder)  # without the key: a chat model
    (spec,) = model_specs(
        read_config(_config(tmp_path, folder, "rerank")), EngineSettings(), BUDGET
    )
    assert (spec.task, spec.cache_bytes) == ("rerank", 0)  # an encoder keeps no KV cache
    served = spec.build()
    assert served.caps.task == "rerank"
    loaded = served.loaded
    assert isinstance(loaded, LoadedEncoder) and loaded.pair_prompt is RERANKER_PROMPT
    docs, limit = _documents(), 90
    ids, batch = _reference_inputs(folder, docs, limit)
    expected = _yes_no_scores(folder, model, batch)
    tokens, scores = _ours(loaded, docs, limit)
    assert tokens == ids
    np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)


def test_task_generate_keeps_a_folder_named_reranker_a_chat_model(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-Qwen3-Reranker"
    save_reranker(folder, "causal", seed=1)
    assert encoder_task(folder) is EncoderTask.SCORE  # the name decides without the key
    (spec,) = model_specs(
        read_config(_config(tmp_path, folder, "generate")), EngineSettings(), BUDGET
    )
    assert spec.task == "generate" and spec.cache_bytes > 0


def test_the_detected_task_is_on_the_spec_before_any_load(tmp_path: Path) -> None:
    save_embedder(tmp_path / "tiny-qwen3-embedding")
    save_encoder(tmp_path / "tiny-cross-encoder", labels=1)
    (embed, score) = (
        encoder_task(tmp_path / "tiny-qwen3-embedding"),
        encoder_task(tmp_path / "tiny-cross-encoder"),
    )
    assert (embed, score) == (EncoderTask.EMBED, EncoderTask.SCORE)
    file = tmp_path / "models.toml"
    file.write_text(
        f'[[models]]\nsource = "{tmp_path / "tiny-qwen3-embedding"}"\n'
        f'[[models]]\nsource = "{tmp_path / "tiny-cross-encoder"}"\n'
    )
    specs = model_specs(read_config(file), EngineSettings(), BUDGET)
    assert [s.task for s in specs] == ["embed", "rerank"]


def test_a_task_the_files_contradict_fails_at_startup_naming_it(tmp_path: Path) -> None:
    causal = tmp_path / "tiny-qwen3-chat"
    save_reranker(causal, "causal", seed=1)
    seq_cls = tmp_path / "tiny-qwen3-seq-cls"
    save_reranker(seq_cls, "seq-cls", seed=2)
    bert = tmp_path / "tiny-bert-embedder"
    save_encoder(bert)
    cases = [
        (causal, "chat", 'task must be "generate", "embed", "rerank", not \'chat\''),
        (causal, 1, 'task must be "generate", "embed", "rerank", not 1'),
        (causal, "embed", "modules.json with a Pooling module"),
        (seq_cls, "generate", "it serves task \"rerank\", not 'generate'"),
        (bert, "generate", "tiny-bert-embedder serves task \"embed\", not 'generate'"),
        (bert, "rerank", "tiny-bert-embedder serves task \"embed\", not 'rerank'"),
    ]
    for source, task, words in cases:
        file = _config(tmp_path, source, task)
        with pytest.raises(CliError) as err:
            model_specs(read_config(file), EngineSettings(), BUDGET)
        assert words in str(err.value), (task, str(err.value))
    # and the copy named like a reranker is still one: the key changes only its model
    named = tmp_path / "tiny-Qwen3-Reranker"
    shutil.copytree(causal, named)
    assert is_encoder(named) and not is_encoder(named, "generate")
