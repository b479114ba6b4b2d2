"""The real all-MiniLM-L6-v2 (from the PyPI package, through the store) against
sentence-transformers on PyTorch: every one of a few hundred varied sentences (empty-ish,
ordinary, longer than max_seq_length and so truncated, non-Latin scripts, emoji, code)
gets an embedding with cosine >= 0.9999 to the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")

from runtime.load import load_encoder  # noqa: E402
from runtime.text import EncoderTokenizer  # noqa: E402
from tests.support.gguf_encoders import write_bert_gguf  # noqa: E402
from tests.support.tiny_encoders import run_encoder  # noqa: E402

pytestmark = pytest.mark.real_model

_SHORT = ["", " ", ".", "a", "OK", "?", "!!!", "\n\t", "42", "é", "I", "—"]
_NON_LATIN = [
    "这是一个用于测试嵌入模型的中文句子。",
    "日本語の文章もベクトルに変換できますか？",
    "هذه جملة باللغة العربية لاختبار النموذج.",
    "Это предложение на русском языке для проверки.",
    "यह हिंदी में एक परीक्षण वाक्य है।",
    "한국어 문장도 임베딩할 수 있습니다.",
    "Αυτή είναι μια ελληνική πρόταση.",
    "עברית נכתבת מימין לשמאל.",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Emoji 🚀🔥 and mixed 文字 text ✓",
    "Ünïcödé dïäcrïtïcs àñd çédillas",
    "def f(x):\n    return x ** 2  # code",
    "https://example.com/path?query=1&other=two",
]
_SUBJECTS = [
    "the agent",
    "a user",
    "our server",
    "the model",
    "my cat",
    "this city",
    "the committee",
]
_VERBS = ["searches", "remembers", "ranks", "ignores", "describes", "compares", "rewrites"]
_OBJECTS = [
    "the documents about rivers",
    "every file in the repository",
    "a long list of questions",
    "the answer it gave yesterday",
    "embeddings for retrieval",
    "the weather in spring",
]


def _sentences() -> list[str]:
    rng = np.random.default_rng(30)
    out = list(_SHORT) + list(_NON_LATIN)
    for _ in range(230):
        words = []
        for _ in range(int(rng.integers(1, 5))):
            words += [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS) + "."]
        out.append(" ".join(str(w) for w in words))
    base = " ".join(_OBJECTS) + " " + " ".join(_NON_LATIN[:4])
    for n in (3, 5, 9, 15):  # well past 256 tokens: truncated as sentence-transformers does
        out.append((base + " ") * n)
    out += [s * 40 for s in _NON_LATIN[:6]]
    return out


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    return _sentences()


@pytest.fixture(scope="module")
def reference(all_minilm_dir: Path, sentences: list[str]) -> np.ndarray:
    """sentence-transformers' embeddings of `sentences`, once for both tests."""
    model = st.SentenceTransformer(str(all_minilm_dir), device="cpu")
    return np.asarray(model.encode(sentences, batch_size=64))


def test_minilm_equals_sentence_transformers(
    all_minilm_dir: Path, sentences: list[str], reference: np.ndarray
) -> None:
    assert len(sentences) >= 250
    loaded = load_encoder(all_minilm_dir)
    assert loaded.max_length == 256 and loaded.width == 384
    items = EncoderTokenizer(loaded.tokenizer, lowercase=loaded.lowercase).texts(
        sentences, loaded.max_length
    )
    assert sum(t.truncated for t in items) >= 8
    ours = run_encoder(loaded, [t.input for t in items])
    cosines = np.sum(ours * reference, axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
    )
    worst = int(np.argmin(cosines))
    assert cosines.min() >= 0.9999, (sentences[worst][:80], float(cosines[worst]))
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_minilm_from_gguf_equals_sentence_transformers(
    all_minilm_dir: Path, sentences: list[str], reference: np.ndarray, tmp_path: Path
) -> None:
    """The same model as llama.cpp's converter writes it: normalized mean pooling, and
    the same ids (its WordPiece respelled back) cut at the same 256 tokens."""
    path = tmp_path / "all-minilm-l6-v2-f32.gguf"
    write_bert_gguf(all_minilm_dir, path)
    loaded = load_encoder(path)
    assert loaded.max_length == 512 and loaded.width == 384
    folder = load_encoder(all_minilm_dir)
    items = EncoderTokenizer(loaded.tokenizer).texts(sentences, 256)
    theirs = EncoderTokenizer(folder.tokenizer, lowercase=folder.lowercase).texts(sentences, 256)
    assert [t.input for t in items] == [t.input for t in theirs]
    ours = run_encoder(loaded, [t.input for t in items])
    cosines = np.sum(ours * reference, axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
    )
    worst = int(np.argmin(cosines))
    assert cosines.min() >= 0.9999, (sentences[worst][:80], float(cosines[worst]))
