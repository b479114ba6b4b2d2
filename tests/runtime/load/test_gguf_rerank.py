"""A cross-encoder read from GGUF (llama.cpp's converter's layout, tests/support/
gguf_rerankers.py): a RoBERTa-head reranker (cls + cls.output) gives transformers'
scores and order; its byte-level tokenizer frames a pair as RoBERTa does; a
BertForSequenceClassification, whose pooler the converter leaves out, is refused with
the way out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.load import EncoderTask, ScoreActivation, is_encoder, load_encoder  # noqa: E402
from runtime.text import EncoderTokenizer  # noqa: E402
from runtime.types import EncodeInput  # noqa: E402
from tests.support.gguf_rerankers import write_cross_encoder_gguf  # noqa: E402
from tests.support.tiny_encoders import WORDS, run_encoder, save_encoder  # noqa: E402

LIMIT = 40  # some pairs are truncated


def test_roberta_head_scores_equal_transformers(tmp_path: Path) -> None:
    folder, path = tmp_path / "roberta", tmp_path / "roberta.gguf"
    model = save_encoder(folder, "roberta", labels=1, seed=5)
    write_cross_encoder_gguf(folder, path)
    assert is_encoder(path)
    loaded = load_encoder(path)
    assert loaded.task is EncoderTask.SCORE and loaded.width == 1
    assert loaded.activation is ScoreActivation.SIGMOID
    rng = np.random.default_rng(3)
    query = "which agent search model ranks the documents"
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 40)))) for _ in range(12)]
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tok([query] * len(docs), docs, padding=True, truncation=True, max_length=LIMIT,
                return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        reference = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
    pairs = zip(batch["input_ids"], batch["attention_mask"], strict=True)
    rows = [EncodeInput(tuple(ids[m.bool()].tolist())) for ids, m in pairs]
    ours = run_encoder(loaded, rows, piece_tokens=96)[:, 0]
    np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)
    assert list(np.argsort(-ours, kind="stable")) == list(np.argsort(-reference, kind="stable"))


def test_byte_level_pairs_are_framed_as_roberta(tmp_path: Path) -> None:
    folder, path = tmp_path / "roberta", tmp_path / "roberta.gguf"
    save_encoder(folder, "roberta", labels=1)
    write_cross_encoder_gguf(folder, path)
    loaded = load_encoder(path)
    bos, eos = loaded.tokenizer.hf.token_to_id("<s>"), loaded.tokenizer.hf.token_to_id("</s>")
    (pair,) = EncoderTokenizer(loaded.tokenizer).pairs("fox", ["river"], LIMIT)
    tokens = pair.input.tokens
    at = tokens.index(eos)
    assert tokens[0] == bos and tokens[at : at + 2] == (eos, eos) and tokens[-1] == eos
    assert pair.input.second_at is None  # one token type, as the model has


def test_bert_without_its_pooler_is_refused(tmp_path: Path) -> None:
    folder, path = tmp_path / "bert", tmp_path / "bert.gguf"
    save_encoder(folder, "bert", labels=1)
    write_cross_encoder_gguf(folder, path)
    assert is_encoder(path)
    with pytest.raises(ValueError, match=r"leaves out a BertForSequenceClassification's pooler"):
        load_encoder(path)
