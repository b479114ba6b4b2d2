"""BERT-family encoders against their oracles on tiny random models: hidden states
against transformers (bert, roberta, xlm-roberta; a padded batch), pooled and
normalized embeddings against sentence-transformers (each pooling mode, truncated
inputs), and a cross-encoder's scores and rerank order against transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from runtime.load import EncoderTask, load_encoder  # noqa: E402
from runtime.text import EncoderTokenizer  # noqa: E402
from tests.support.tiny_encoders import MAX_SEQ_LENGTH, WORDS, run_encoder, save_encoder  # noqa: E402

ATOL = 1e-4
KINDS = ("bert", "roberta", "xlm-roberta")


def _texts(count: int = 24, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = ["", "a", "the", "zzz qqq!", "Fox, river; MOUNTAIN."]
    for _ in range(count):
        n = int(rng.integers(1, 70))  # some beyond MAX_SEQ_LENGTH: truncated
        texts.append(" ".join(str(rng.choice(WORDS)) for _ in range(n)))
    return texts


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_equal_transformers(tmp_path: Path, kind: str) -> None:
    model = save_encoder(tmp_path, kind)
    loaded = load_encoder(tmp_path)
    tok = EncoderTokenizer(loaded.tokenizer)
    rows = [t.input.tokens for t in tok.texts(_texts(8), loaded.max_length)]
    length = max(len(r) for r in rows)
    pad = loaded.model.args.pad_token_id
    right = np.full((len(rows), length), pad, dtype=np.int64)
    left = np.full((len(rows), length), pad, dtype=np.int32)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for i, r in enumerate(rows):
        right[i, : len(r)] = r
        left[i, length - len(r) :] = r
        mask[i, : len(r)] = 1
    with torch.no_grad():
        ids, att = torch.tensor(right), torch.tensor(mask)
        ref = model(input_ids=ids, attention_mask=att).last_hidden_state.numpy()
    padding = [length - len(r) for r in rows]
    ours = np.array(loaded.model.forward(mx.array(left), padding))
    for i, r in enumerate(rows):
        np.testing.assert_allclose(ours[i, padding[i] :], ref[i, : len(r)], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("kind", "pooling", "normalize"),
    [
        ("bert", ("mean",), True),
        ("bert", ("cls",), False),
        ("bert", ("max",), True),
        ("bert", ("mean_sqrt_len",), False),
        ("bert", ("lasttoken",), True),
        ("bert", ("cls", "mean", "max"), True),
        ("roberta", ("mean",), True),
        ("xlm-roberta", ("cls",), True),
    ],
)
def test_embeddings_equal_sentence_transformers(
    tmp_path: Path, kind: str, pooling: tuple[str, ...], normalize: bool
) -> None:
    save_encoder(tmp_path, kind, pooling=pooling, normalize=normalize)
    texts = _texts()
    reference = st.SentenceTransformer(str(tmp_path), device="cpu").encode(texts)
    loaded = load_encoder(tmp_path)
    assert loaded.task is EncoderTask.EMBED and loaded.max_length == MAX_SEQ_LENGTH
    items = EncoderTokenizer(loaded.tokenizer).texts(texts, loaded.max_length)
    assert any(t.truncated for t in items)  # the long ones are cut to max_seq_length
    # small pieces: each input's row must not depend on what it was batched with
    ours = run_encoder(loaded, [t.input for t in items], piece_tokens=160)
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=ATOL, rtol=0)
    assert _cosines(ours, reference).min() >= 0.99999
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_token_ids_equal_sentence_transformers_tokenizer(tmp_path: Path) -> None:
    save_encoder(tmp_path, "bert")
    texts = _texts()
    model = st.SentenceTransformer(str(tmp_path), device="cpu")
    theirs = model.tokenize(texts)
    loaded = load_encoder(tmp_path)
    ours = EncoderTokenizer(loaded.tokenizer).texts(texts, loaded.max_length)
    for i, item in enumerate(ours):
        n = int(theirs["attention_mask"][i].sum())
        assert list(item.input.tokens) == theirs["input_ids"][i][:n].tolist()


def _pairs(count: int = 12) -> tuple[str, list[str]]:
    rng = np.random.default_rng(3)
    query = "which agent search model ranks the documents"
    docs = [
        " ".join(str(rng.choice(WORDS)) for _ in range(int(rng.integers(2, 40))))
        for _ in range(count)
    ]
    return query, docs


def _transformers_scores(folder: Path, model: Any, query: str, docs: list[str], limit: int) -> Any:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tok([query] * len(docs), docs, padding=True, truncation=True, max_length=limit,
                return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        logits = model(**batch).logits[:, 0]
    return torch.sigmoid(logits).numpy()


@pytest.mark.parametrize("kind", ("bert", "roberta"))
def test_cross_encoder_scores_and_order_equal_transformers(tmp_path: Path, kind: str) -> None:
    model = save_encoder(tmp_path, kind, labels=1, seed=5)
    loaded = load_encoder(tmp_path)
    assert loaded.task is EncoderTask.SCORE and loaded.width == 1
    query, docs = _pairs()
    limit = 32  # some pairs are truncated, longest side first
    reference = _transformers_scores(tmp_path, model, query, docs, limit)
    items = EncoderTokenizer(loaded.tokenizer).pairs(query, docs, limit)
    assert any(t.truncated for t in items)
    ours = run_encoder(loaded, [t.input for t in items], piece_tokens=96)[:, 0]
    np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)
    assert list(np.argsort(-ours, kind="stable")) == list(np.argsort(-reference, kind="stable"))


def test_pair_truncation_equals_the_tokenizers_longest_first(tmp_path: Path) -> None:
    save_encoder(tmp_path, "bert", labels=1)
    loaded = load_encoder(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    rng = np.random.default_rng(7)
    tok = EncoderTokenizer(loaded.tokenizer)
    for _ in range(40):
        query = " ".join(str(rng.choice(WORDS)) for _ in range(int(rng.integers(1, 30))))
        doc = " ".join(str(rng.choice(WORDS)) for _ in range(int(rng.integers(1, 30))))
        limit = int(rng.integers(6, 40))
        expected = hf(query, doc, truncation="longest_first", max_length=limit)["input_ids"]
        (ours,) = tok.pairs(query, [doc], limit)
        assert list(ours.input.tokens) == expected


def test_refuses_an_unsupported_module(tmp_path: Path) -> None:
    save_encoder(tmp_path, "bert")
    modules = (tmp_path / "modules.json").read_text().replace("Normalize", "Dense")
    (tmp_path / "modules.json").write_text(modules)
    with pytest.raises(ValueError, match="Dense"):
        load_encoder(tmp_path)
