"""Qwen3 embedding models and rerankers served through the real app: a tiny random
Qwen3-Embedding-like model behind /v1/embeddings (the official OpenAI SDK as the client,
sentence-transformers as the oracle, Matryoshka `dimensions` from the per-model sizes)
and a tiny Qwen3-Reranker-like causal LM behind /v1/rerank (its folder name says
reranker; scores are the model card's yes/no probability, computed with transformers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from openai.types import CreateEmbeddingResponse  # noqa: E402

from gateway.core.models import ModelRegistry, ModelSpec, build_served  # noqa: E402
from gateway.core.models.encoders import build_encoder_served  # noqa: E402
from runtime.load.decoder_encoder import RERANKER_PROMPT  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.openai_checks import post  # noqa: E402
from tests.support.tiny_decoder_encoders import HIDDEN, save_embedder, save_reranker  # noqa: E402
from tests.support.tiny_encoders import WORDS  # noqa: E402

EMBED, RERANK = "tiny-qwen3-embedding", "tiny-Qwen3-Reranker"
QUERY = "which agent search model ranks the documents"
TEXTS = [
    "Instruct: Given a web search query, retrieve relevant passages\nQuery: fox river",
    "the fox sleeps by the river",
    "a",
    "",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("qwen3-encoders")
    save_embedder(root / EMBED)
    model = save_reranker(root / RERANK, "causal", seed=7)

    def embed() -> Any:
        return build_encoder_served(root / EMBED, model_id=EMBED, dimensions=(32, 16))

    def rerank() -> Any:
        return build_served(root / RERANK, model_id=RERANK)  # detected by its name

    registry = ModelRegistry([ModelSpec(EMBED, embed), ModelSpec(RERANK, rerank)])
    with live_server(registry) as url:
        yield url, {EMBED: root / EMBED, RERANK: root / RERANK, "reranker": model}


@pytest.fixture(scope="module")
def client(setup: tuple[str, dict[str, Any]]) -> Any:
    return openai.OpenAI(base_url=f"{setup[0]}/v1", api_key="none", max_retries=0)


def test_sdk_embeddings_equal_sentence_transformers(
    setup: tuple[str, dict[str, Any]], client: Any
) -> None:
    reference = st.SentenceTransformer(str(setup[1][EMBED]), device="cpu")
    expected = reference.encode(TEXTS)
    got = client.embeddings.create(model=EMBED, input=TEXTS)  # base64, as the SDK asks
    assert isinstance(got, CreateEmbeddingResponse)
    np.testing.assert_allclose([d.embedding for d in got.data], expected, atol=1e-4)
    tokens = int(reference.tokenize(TEXTS)["attention_mask"].sum())  # <|endoftext|> counted
    assert got.usage.prompt_tokens == tokens
    floats = client.embeddings.create(model=EMBED, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, expected[1], atol=1e-4)


def test_matryoshka_dimensions(setup: tuple[str, dict[str, Any]], client: Any) -> None:
    expected = st.SentenceTransformer(str(setup[1][EMBED]), device="cpu").encode(TEXTS)
    cut = client.embeddings.create(model=EMBED, input=TEXTS, dimensions=32).data
    for row, want in zip(cut, expected, strict=True):
        head = want[:32] / np.linalg.norm(want[:32])  # truncated, then normalized again
        np.testing.assert_allclose(row.embedding, head, atol=1e-4)
    assert (
        len(client.embeddings.create(model=EMBED, input="a", dimensions=HIDDEN).data[0].embedding)
        == HIDDEN
    )
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=EMBED, input="a", dimensions=24)
    assert exc.value.status_code == 400 and "32, 16" in str(exc.value)


def _documents(count: int = 8) -> list[str]:
    rng = np.random.default_rng(4)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 30)))) for _ in range(count)]


def _model_card_scores(folder: Path, model: Any, docs: list[str]) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), padding_side="left")
    prefix = tok.encode(RERANKER_PROMPT.prefix, add_special_tokens=False)
    suffix = tok.encode(RERANKER_PROMPT.suffix, add_special_tokens=False)
    bodies = [RERANKER_PROMPT.template.format(query=QUERY, document=d) for d in docs]
    ids = [prefix + tok.encode(b, add_special_tokens=False) + suffix for b in bodies]
    batch = tok.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    with torch.no_grad():
        logits = model(**batch).logits[:, -1, :]
    pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)
    return np.asarray(torch.softmax(pair, dim=1)[:, 1].numpy())


def test_rerank_with_the_yes_no_reranker(setup: tuple[str, dict[str, Any]]) -> None:
    url, parts = setup
    docs = _documents()
    expected = _model_card_scores(parts[RERANK], parts["reranker"], docs)
    r = post(url, "/v1/rerank", {"model": RERANK, "query": QUERY, "documents": docs, "top_n": 5})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(-expected, kind="stable"))[:5]
    scores = [x["relevance_score"] for x in results]
    np.testing.assert_allclose(scores, np.sort(expected)[::-1][:5], atol=1e-5)
    r = post(url, "/v1/embeddings", {"model": RERANK, "input": "a"})
    assert r.status_code == 400  # a reranker gives no embeddings
