"""ModernBERT (runtime/models/modernbert.py) against its oracles on tiny random models:
hidden states against transformers' ModernBertModel on a left-padded batch whose longer
rows pass the local layers' band (1e-4, float32), pooled and normalized embeddings
against sentence-transformers, and a ModernBertForSequenceClassification's scores and
rerank order (cls and mean pooling) against transformers'. nomic-bert, whose code ships
with its checkpoints, is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.load import EncoderTask, load_encoder  # noqa: E402
from runtime.models.modernbert import ModelArgs  # noqa: E402
from runtime.text import EncoderTokenizer  # noqa: E402
from tests.support.tiny_encoders import VOCAB, WORDS, run_encoder, save_encoder  # noqa: E402

ATOL = 1e-4
LOCAL_ATTENTION = 16  # a local layer's query sees 8 keys either side
MAX_SEQ_LENGTH = 64


def _modernbert(*, labels: int = 0, pooling: str = "cls", seed: int = 0) -> Any:
    """A tiny random ModernBERT (4 layers: 0 and 3 global, 1 and 2 local) in eval mode."""
    torch.manual_seed(seed)
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=128, global_attn_every_n_layers=3,
        local_attention=LOCAL_ATTENTION, global_rope_theta=1000.0, local_rope_theta=50.0,
        pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
        num_labels=max(labels, 1), classifier_pooling=pooling, attn_implementation="eager",
    )  # fmt: skip
    cls = (
        transformers.ModernBertForSequenceClassification if labels else transformers.ModernBertModel
    )
    model = cls(config)
    with torch.no_grad():  # random weights are small: sharpen attention, widen the MLP's range
        for name, param in model.named_parameters():
            if "Wqkv" in name or "Wi" in name:
                param.mul_(8.0)
    return model.eval()


def _save(folder: Path, **kwargs: Any) -> Any:
    """A sentence-transformers folder (tiny_encoders' tokenizer and modules) holding a
    ModernBERT: the model files replace the BERT ones, and the tokenizer hands over no
    token types (ModernBERT takes none)."""
    labels = int(kwargs.get("labels", 0))
    save_encoder(folder, "bert", labels=labels, max_seq_length=MAX_SEQ_LENGTH)
    model = _modernbert(**kwargs)
    model.save_pretrained(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model


def _texts(count: int = 16, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = ["", "a", "the fox", "Fox, river; MOUNTAIN."]
    for _ in range(count):
        n = int(rng.integers(1, 60))  # many rows longer than the band (17 columns)
        texts.append(" ".join(str(rng.choice(WORDS)) for _ in range(n)))
    return texts


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("modernbert") / "model"
    return folder, _save(folder)


def test_hidden_states_equal_transformers(embedder: tuple[Path, Any]) -> None:
    folder, model = embedder
    loaded = load_encoder(folder)
    assert isinstance(loaded.model.args, ModelArgs)
    assert loaded.model.args.global_layers == (True, False, False, True)
    rows = [t.input.tokens for t in EncoderTokenizer(loaded.tokenizer).texts(_texts())]
    length = max(len(r) for r in rows)
    assert length > 2 * LOCAL_ATTENTION  # the band hides keys from the local layers
    right = np.zeros((len(rows), length), dtype=np.int64)
    left = np.zeros((len(rows), length), dtype=np.int32)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for i, r in enumerate(rows):
        right[i, : len(r)] = r
        left[i, length - len(r) :] = r
        mask[i, : len(r)] = 1
    with torch.no_grad():
        ids, att = torch.tensor(right), torch.tensor(mask)
        reference = model(input_ids=ids, attention_mask=att).last_hidden_state.numpy()
    padding = [length - len(r) for r in rows]
    ours = np.array(loaded.model.forward(mx.array(left), padding))
    assert np.isfinite(ours).all()  # padded queries included: no NaN can leak
    for i, r in enumerate(rows):
        np.testing.assert_allclose(ours[i, padding[i] :], reference[i, : len(r)], atol=ATOL, rtol=0)


def test_embeddings_equal_sentence_transformers(embedder: tuple[Path, Any]) -> None:
    st = pytest.importorskip("sentence_transformers")
    folder, _ = embedder
    texts = _texts(24, seed=1)
    reference = st.SentenceTransformer(str(folder), device="cpu").encode(texts)
    loaded = load_encoder(folder)
    assert loaded.task is EncoderTask.EMBED and loaded.max_length == MAX_SEQ_LENGTH
    items = EncoderTokenizer(loaded.tokenizer).texts(texts, loaded.max_length)
    # small pieces: a row must not depend on what it was batched with
    ours = run_encoder(loaded, [t.input for t in items], piece_tokens=200)
    np.testing.assert_allclose(ours, reference, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_cross_encoder_scores_and_order_equal_transformers(tmp_path: Path, pooling: str) -> None:
    model = _save(tmp_path, labels=1, pooling=pooling, seed=5)
    loaded = load_encoder(tmp_path)
    assert loaded.task is EncoderTask.SCORE and loaded.width == 1
    rng = np.random.default_rng(3)
    query = "which agent search model ranks the documents"
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 50)))) for _ in range(12)]
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    batch = tok([query] * len(docs), docs, padding=True, truncation=True,
                max_length=MAX_SEQ_LENGTH, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        reference = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
    items = EncoderTokenizer(loaded.tokenizer).pairs(query, docs, MAX_SEQ_LENGTH)
    pairs = zip(batch["input_ids"], batch["attention_mask"], strict=True)
    assert [list(t.input.tokens) for t in items] == [ids[m.bool()].tolist() for ids, m in pairs]
    ours = run_encoder(loaded, [t.input for t in items], piece_tokens=160)[:, 0]
    np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)
    assert list(np.argsort(-ours, kind="stable")) == list(np.argsort(-reference, kind="stable"))


def test_nomic_bert_is_refused_by_name(tmp_path: Path) -> None:
    config = {"model_type": "nomic_bert", "architectures": ["NomicBertModel"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"emb.weight": mx.zeros((4, 2))})
    with pytest.raises(ValueError, match=r"nomic-bert.*not supported"):
        load_encoder(tmp_path)
