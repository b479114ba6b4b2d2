"""The rerank dialect (POST /v1/rerank, /rerank, /v2/rerank) on a tiny random BERT
cross-encoder: order and scores equal transformers' sigmoid of the classifier's logit,
top_n and return_documents shape the results, object documents are read by their text,
and every refusal is a 400 in the error shape the gateway gives outside /v1/messages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gateway.core.models import ModelRegistry, ModelSpec, build_served  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.openai_checks import post  # noqa: E402
from tests.support.tiny_encoders import MAX_SEQ_LENGTH, WORDS, save_encoder  # noqa: E402

RERANK, EMBED = "tiny-rerank", "tiny-embed"
QUERY = "which agent search model ranks the documents"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Any]]:
    root = tmp_path_factory.mktemp("rerank")
    model = save_encoder(root / RERANK, "bert", labels=1, seed=5)
    save_encoder(root / EMBED, "bert")

    def build(name: str) -> Any:
        return lambda: build_served(root / name, model_id=name)

    models = ModelRegistry([ModelSpec(RERANK, build(RERANK)), ModelSpec(EMBED, build(EMBED))])
    with live_server(models) as url:
        yield url, root / RERANK, model


def _documents(count: int = 10) -> list[str]:
    rng = np.random.default_rng(11)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 60)))) for _ in range(count)]


def _reference(folder: Path, model: Any, docs: list[str]) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tok([QUERY] * len(docs), docs, padding=True, truncation=True,
                max_length=MAX_SEQ_LENGTH, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        return np.asarray(torch.sigmoid(model(**batch).logits[:, 0]).numpy())


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_order_and_scores_equal_transformers(setup: tuple[str, Path, Any], path: str) -> None:
    url, folder, model = setup
    docs = _documents()
    expected = _reference(folder, model, docs)
    r = post(url, path, {"model": RERANK, "query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == RERANK and out["usage"]["total_tokens"] > 0
    results = out["results"]
    assert [x["index"] for x in results] == list(np.argsort(-expected, kind="stable"))
    scores = [x["relevance_score"] for x in results]
    np.testing.assert_allclose(scores, np.sort(expected)[::-1], atol=1e-5)
    assert all(x["document"] == {"text": docs[x["index"]]} for x in results)


def test_top_n_objects_and_no_documents(setup: tuple[str, Path, Any]) -> None:
    url, _, _ = setup
    docs = _documents()
    full = post(url, "/v1/rerank", {"model": RERANK, "query": QUERY, "documents": docs}).json()
    r = post(url, "/v1/rerank", {
        "model": RERANK, "query": QUERY, "documents": [{"text": d} for d in docs],
        "top_n": 3, "return_documents": False,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full["results"][:3]]
    assert all(set(x) == {"index", "relevance_score"} for x in top)


def test_long_documents_are_truncated_not_refused(setup: tuple[str, Path, Any]) -> None:
    url, folder, model = setup
    docs = [" ".join(["river"] * 200), "the cat", " ".join(["mountain"] * 90)]
    expected = _reference(folder, model, docs)
    r = post(url, "/v1/rerank", {"model": RERANK, "query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    np.testing.assert_allclose([got[i] for i in range(3)], expected, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": RERANK, "query": QUERY, "documents": []}, "documents"),
        ({"model": RERANK, "query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
        (
            {"model": RERANK, "query": QUERY, "documents": ["a"], "rank_fields": ["title"]},
            "rank_fields",
        ),
        ({"model": RERANK, "documents": ["a"]}, "query"),
        ({"model": EMBED, "query": QUERY, "documents": ["a"]}, "model"),
    ],
)
def test_refusals(setup: tuple[str, Path, Any], body: dict[str, Any], param: str) -> None:
    url, _, _ = setup
    r = post(url, "/v1/rerank", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "")
    assert error["message"]
