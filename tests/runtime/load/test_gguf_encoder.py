"""A BERT embedding model read from GGUF (llama.cpp's converter's layout): its WordPiece
tokenizer gives the HF tokenizer's ids (texts and pairs), and its embeddings equal the
same model's read from its folder (F32 to float precision, Q8_0 close), for mean and CLS
pooling; what it cannot serve is refused by name. The real all-MiniLM-L6-v2 as GGUF
against sentence-transformers: tests/runtime/models/test_minilm_real.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf.constants import GGMLQuantizationType as QT

from runtime.load import EncoderTask, is_encoder, load_encoder
from runtime.text import EncoderTokenizer
from tests.support.gguf_encoders import write_bert_gguf
from tests.support.tiny_encoders import WORDS, run_encoder, save_encoder

TEXTS = ["", "a", "The FOX, the river; mountain!", "zzz qqq 42", "Ünïcödé wörds", "[CLS] x"]


def _texts() -> list[str]:
    rng = np.random.default_rng(3)
    return TEXTS + [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(30)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-bert-gguf") / "model"
    save_encoder(folder, "bert")
    return folder


def _embeddings(source: Path, texts: list[str]) -> np.ndarray:
    loaded = load_encoder(source)
    items = EncoderTokenizer(loaded.tokenizer, lowercase=loaded.lowercase).texts(texts, 48)
    return np.asarray(run_encoder(loaded, [t.input for t in items]))


def test_tokenizer_gives_the_folders_ids(tiny: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_bert_gguf(tiny, path)
    ours, theirs = load_encoder(path).tokenizer, load_encoder(tiny).tokenizer
    texts = _texts()
    a, b = EncoderTokenizer(ours).texts(texts), EncoderTokenizer(theirs).texts(texts)
    assert [t.input for t in a] == [t.input for t in b]
    pairs = EncoderTokenizer(ours).pairs("the query", texts, 40)
    assert pairs == EncoderTokenizer(theirs).pairs("the query", texts, 40)
    assert any(p.input.second_at for p in pairs)


@pytest.mark.parametrize(("quant", "atol"), [(None, 1e-5), (QT.Q8_0, 2e-2)])
def test_embeddings_equal_the_folders(
    tiny: Path, tmp_path: Path, quant: QT | None, atol: float
) -> None:
    path = tmp_path / "tiny.gguf"
    write_bert_gguf(tiny, path, quant=quant)
    assert is_encoder(path)
    loaded = load_encoder(path)
    assert loaded.task is EncoderTask.EMBED and loaded.pooling is not None
    assert loaded.pooling.normalize and loaded.max_length == loaded.model.args.max_positions
    texts = _texts()
    ours, reference = _embeddings(path, texts), _embeddings(tiny, texts)
    np.testing.assert_allclose(ours, reference, atol=atol, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_cls_pooling(tmp_path: Path) -> None:
    folder = tmp_path / "cls"
    save_encoder(folder, "bert", pooling=("cls",), seed=2)
    path = tmp_path / "cls.gguf"
    write_bert_gguf(folder, path, pooling_type=2)
    texts = _texts()
    np.testing.assert_allclose(
        _embeddings(path, texts), _embeddings(folder, texts), atol=1e-5, rtol=0
    )


def test_what_is_not_served_is_refused(tiny: Path, tmp_path: Path) -> None:
    path = tmp_path / "rank.gguf"
    write_bert_gguf(tiny, path, pooling_type=4)
    with pytest.raises(ValueError, match="pooling type 'rank'"):
        load_encoder(path)
    other = tmp_path / "notes.gguf"
    other.write_bytes(b"not a gguf at all")
    assert not is_encoder(other)
