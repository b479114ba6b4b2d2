"""Qwen3 decoders served as encoders, against their oracles on tiny random models:
hidden states of a left-padded batch against transformers' Qwen3Model (the CPU kernels
and MLX's ops), pooled and normalized embeddings and token ids against
sentence-transformers, Qwen3ForSequenceClassification scores and Qwen3-Reranker's yes/no
scores (the model card's formula, computed with transformers) and their order, and the
GGUF files llama.cpp's converter writes for both against the HF folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from runtime import kernels as cpu_kernels  # noqa: E402
from runtime.load import EncoderTask, LoadedEncoder, is_encoder, load_encoder  # noqa: E402
from runtime.load.decoder_encoder import RERANKER_PROMPT  # noqa: E402
from runtime.text import EncoderTokenizer  # noqa: E402
from tests.support.tiny_decoder_encoders import (  # noqa: E402
    EOT,
    MAX_SEQ_LENGTH,
    save_embedder,
    save_reranker,
    write_gguf,
)
from tests.support.tiny_encoders import WORDS, run_encoder  # noqa: E402

ATOL = 1e-4
QUERY = "which agent search model ranks the documents"


def _texts(count: int = 20, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = ["", "a", "yes", "zzz qqq!", "Fox, river; MOUNTAIN.", "Instruct: find\nQuery: fox"]
    for _ in range(count):
        n = int(rng.integers(1, 60))  # some beyond MAX_SEQ_LENGTH tokens: truncated
        texts.append(" ".join(str(rng.choice(WORDS)) for _ in range(n)))
    return texts


def _documents(count: int = 10, seed: int = 3) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        " ".join(str(rng.choice(WORDS)) for _ in range(int(rng.integers(1, 50))))
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decoder-encoders")


@pytest.fixture(scope="module")
def embedder(root: Path) -> tuple[Path, Any]:
    folder = root / "tiny-qwen3-embedding"
    return folder, save_embedder(folder)


def _left_padded(rows: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    length = max(len(r) for r in rows)
    ids = np.zeros((len(rows), length), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :] = r
        mask[i, length - len(r) :] = 1
    return ids, mask, [length - len(r) for r in rows]


@pytest.mark.parametrize("kernels", ["cpu-kernels", "mlx-ops"])
def test_hidden_states_equal_transformers(
    embedder: tuple[Path, Any], kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernels == "mlx-ops":
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    folder, model = embedder
    loaded = load_encoder(folder)
    rows = [t.input.tokens for t in EncoderTokenizer(loaded.tokenizer).texts(_texts(6))]
    ids, mask, padding = _left_padded(rows)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)  # each row from 0
    with torch.no_grad():
        ref = model(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).last_hidden_state.numpy()  # fmt: skip
    ours = np.array(loaded.model.forward(mx.array(ids.astype(np.int32)), padding))
    for i, pad in enumerate(padding):
        np.testing.assert_allclose(ours[i, pad:], ref[i, pad:], atol=ATOL, rtol=0)


def test_embeddings_and_tokens_equal_sentence_transformers(embedder: tuple[Path, Any]) -> None:
    folder, _ = embedder
    texts = _texts()
    reference = st.SentenceTransformer(str(folder), device="cpu")
    expected = reference.encode(texts)
    loaded = load_encoder(folder)
    assert loaded.task is EncoderTask.EMBED and loaded.max_length == MAX_SEQ_LENGTH
    assert loaded.width == expected.shape[1]
    items = EncoderTokenizer(loaded.tokenizer).texts(texts, loaded.max_length)
    assert any(t.truncated for t in items)
    theirs = reference.tokenize(texts)
    eot = loaded.tokenizer.hf.token_to_id(EOT)
    for i, item in enumerate(items):
        n = int(theirs["attention_mask"][i].sum())
        real = theirs["input_ids"][i][theirs["attention_mask"][i].bool()].tolist()
        assert list(item.input.tokens) == real and len(real) == n
        assert item.input.tokens[-1] == eot  # the pooled token, kept when truncated
    # small pieces: a row must not depend on what it is batched with
    ours = run_encoder(loaded, [t.input for t in items], piece_tokens=96)
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_a_tokenizer_without_the_eos_processor_gets_one(
    root: Path, embedder: tuple[Path, Any]
) -> None:
    folder, _ = embedder
    bare = root / "tiny-qwen3-embedding-old-tokenizer"
    save_embedder(bare, append_eos=False)  # the same seed: the same weights
    texts = _texts(6)
    expected = st.SentenceTransformer(str(folder), device="cpu").encode(texts)
    loaded = load_encoder(bare)
    items = EncoderTokenizer(loaded.tokenizer).texts(texts, loaded.max_length)
    assert all(t.input.tokens[-1] == loaded.tokenizer.hf.token_to_id(EOT) for t in items)
    ours = run_encoder(loaded, [t.input for t in items])
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)


def test_folders_are_told_apart(root: Path, embedder: tuple[Path, Any]) -> None:
    chat = root / "tiny-qwen3-chat"
    save_reranker(chat, "causal", seed=1)
    assert not is_encoder(chat)  # a causal LM named like a chat model is a chat model
    named = root / "tiny-Qwen3-Reranker"
    shutil.copytree(chat, named)
    assert is_encoder(named) and is_encoder(embedder[0])
    assert load_encoder(named).task is EncoderTask.SCORE


def _reference_inputs(folder: Path, docs: list[str], limit: int) -> tuple[Any, Any]:
    """Qwen3-Reranker's model-card tokenization: prefix and suffix tokens around the
    formatted pair, truncated to the rest of the limit, left-padded."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), padding_side="left")
    prefix = tok.encode(RERANKER_PROMPT.prefix, add_special_tokens=False)
    suffix = tok.encode(RERANKER_PROMPT.suffix, add_special_tokens=False)
    bodies = [RERANKER_PROMPT.template.format(query=QUERY, document=d) for d in docs]
    budget = limit - len(prefix) - len(suffix)
    enc = tok(bodies, padding=False, truncation="longest_first", max_length=budget,
              return_attention_mask=False)  # fmt: skip
    ids = [prefix + e + suffix for e in enc["input_ids"]]
    return ids, tok.pad({"input_ids": ids}, padding=True, return_tensors="pt")


def _yes_no_scores(folder: Path, model: Any, batch: Any) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    with torch.no_grad():
        logits = model(**batch).logits[:, -1, :]
    pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)
    return np.asarray(torch.nn.functional.log_softmax(pair, dim=1)[:, 1].exp().numpy())


def _ours(loaded: LoadedEncoder, docs: list[str], limit: int) -> tuple[list[Any], np.ndarray]:
    assert loaded.pair_prompt is not None
    items = loaded.pair_prompt.pairs(loaded.tokenizer, QUERY, docs, limit)
    inputs = [t.input for t in items]
    return [list(i.tokens) for i in inputs], run_encoder(loaded, inputs, piece_tokens=256)[:, 0]


@pytest.mark.parametrize("tied", [True, False])
def test_yes_no_reranker_scores_equal_the_model_cards_formula(root: Path, tied: bool) -> None:
    folder = root / f"tiny-qwen3-reranker-{'tied' if tied else 'untied'}"
    model = save_reranker(folder, "causal", seed=7, tied=tied)
    loaded = load_encoder(folder)
    assert loaded.task is EncoderTask.SCORE and loaded.width == 1
    docs, limit = _documents(), 90  # the longer pairs are cut at the document's end
    ids, batch = _reference_inputs(folder, docs, limit)
    expected = _yes_no_scores(folder, model, batch)
    tokens, scores = _ours(loaded, docs, limit)
    assert tokens == ids and max(map(len, ids)) == limit
    np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)
    assert list(np.argsort(-scores, kind="stable")) == list(np.argsort(-expected, kind="stable"))


def test_sequence_classification_scores_equal_transformers(root: Path) -> None:
    folder = root / "tiny-qwen3-reranker-seq-cls"
    model = save_reranker(folder, "seq-cls", seed=9)
    loaded = load_encoder(folder)
    assert loaded.task is EncoderTask.SCORE
    docs, limit = _documents(seed=5), 90
    ids, batch = _reference_inputs(folder, docs, limit)
    with torch.no_grad():
        expected = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
    tokens, scores = _ours(loaded, docs, limit)
    assert tokens == ids
    np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)
    assert list(np.argsort(-scores, kind="stable")) == list(np.argsort(-expected, kind="stable"))


def test_gguf_embedder_equals_its_folder(root: Path, embedder: tuple[Path, Any]) -> None:
    folder, _ = embedder
    path = root / "tiny-qwen3-embedding.gguf"
    write_gguf(folder, path, pooling_type=3)
    assert is_encoder(path)
    texts = _texts(10)
    expected = st.SentenceTransformer(str(folder), device="cpu").encode(texts)
    loaded = load_encoder(path)
    assert loaded.task is EncoderTask.EMBED and loaded.width == expected.shape[1]
    items = EncoderTokenizer(loaded.tokenizer).texts(texts, MAX_SEQ_LENGTH)
    ours = run_encoder(loaded, [t.input for t in items])
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)


def test_gguf_reranker_equals_its_folder(root: Path) -> None:
    folder = root / "tiny-qwen3-reranker-for-gguf"
    save_reranker(folder, "causal", seed=11, tied=False)
    path = root / "reranker.gguf"
    write_gguf(folder, path, pooling_type=4)
    docs, limit = _documents(seed=8), 90
    _, expected = _ours(load_encoder(folder), docs, limit)
    assert is_encoder(path)
    _, scores = _ours(load_encoder(path), docs, limit)
    np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)


def test_a_qwen3_gguf_without_pooling_is_a_chat_model(
    root: Path, embedder: tuple[Path, Any]
) -> None:
    folder = root / "tiny-qwen3-chat-for-gguf"
    save_reranker(folder, "causal", seed=2)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    path = root / "chat.gguf"
    write_gguf(folder, path, pooling_type=None)
    assert not is_encoder(path)
