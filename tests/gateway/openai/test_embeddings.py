"""POST /v1/embeddings against a server with three models on one registry: a tiny chat
model (the default), a tiny random BERT embedding model and a tiny cross-encoder. The
official OpenAI SDK is the client and its types the oracle; values are checked against
the encoder run directly; every refusal is a 400 in OpenAI's error shape."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from openai.types import CreateEmbeddingResponse  # noqa: E402

from gateway.core.errors import InvalidRequest  # noqa: E402
from gateway.core.models import ModelRegistry, ModelSpec, build_served  # noqa: E402
from gateway.core.models.encoders import build_encoder_served  # noqa: E402
from gateway.openai.embeddings import EmbeddingPlan, tokenize  # noqa: E402
from runtime.load import LoadedEncoder, load_encoder  # noqa: E402
from runtime.text import EncoderTokenizer  # noqa: E402
from tests.support.agent_model import build_tiny_qwen3  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.openai_checks import post  # noqa: E402
from tests.support.tiny_encoders import HIDDEN, MAX_SEQ_LENGTH, run_encoder, save_encoder  # noqa: E402

CHAT, EMBED, RERANK = "tiny-chat", "tiny-embed", "tiny-rerank"
TEXTS = ["the cat on the mat", "a", "", "search memory agent query document rank"]


@pytest.fixture(scope="module")
def folders(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    save_encoder(root / EMBED, "bert")
    save_encoder(root / RERANK, "bert", labels=1, seed=5)
    return {
        CHAT: build_tiny_qwen3(qwen3_tokenizer_dir, root / CHAT),
        EMBED: root / EMBED,
        RERANK: root / RERANK,
    }


def registry(folders: dict[str, Path]) -> ModelRegistry:
    def chat() -> Any:
        return build_served(folders[CHAT], model_id=CHAT)

    def embed() -> Any:
        return build_encoder_served(folders[EMBED], model_id=EMBED, dimensions=(32, 16))

    def rerank() -> Any:
        return build_served(folders[RERANK], model_id=RERANK)  # an encoder folder: detected

    return ModelRegistry(
        [ModelSpec(CHAT, chat), ModelSpec(EMBED, embed), ModelSpec(RERANK, rerank)],
        memory_budget=1 << 34,
    )


@pytest.fixture(scope="module")
def base_url(folders: dict[str, Path]) -> Iterator[str]:
    with live_server(registry(folders)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def loaded(folders: dict[str, Path]) -> LoadedEncoder:
    return load_encoder(folders[EMBED])


def _reference(loaded: LoadedEncoder, texts: list[str], limit: int | None = None) -> np.ndarray:
    items = EncoderTokenizer(loaded.tokenizer).texts(texts, limit)
    return np.asarray(run_encoder(loaded, [t.input for t in items]))


def _error(exc: Any) -> dict[str, Any]:
    body = exc.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}, body
    assert body["type"] == "invalid_request_error" and exc.value.status_code == 400
    return body


def test_sdk_round_trip_base64_and_float(client: Any, loaded: LoadedEncoder) -> None:
    reference = _reference(loaded, TEXTS)
    got = client.embeddings.create(model=EMBED, input=TEXTS)  # the SDK asks for base64
    assert isinstance(got, CreateEmbeddingResponse) and got.model == EMBED
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose([d.embedding for d in got.data], reference, atol=1e-6)
    floats = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], reference, atol=1e-6)
    tokens = EncoderTokenizer(loaded.tokenizer).texts(TEXTS)
    total = sum(len(t.input.tokens) for t in tokens)
    assert got.usage.prompt_tokens == got.usage.total_tokens == total
    CreateEmbeddingResponse.model_validate(floats.model_dump())


def test_string_and_token_id_inputs(client: Any, loaded: LoadedEncoder) -> None:
    ids = [list(t.input.tokens) for t in EncoderTokenizer(loaded.tokenizer).texts(TEXTS[:2])]
    one = client.embeddings.create(model=EMBED, input=TEXTS[0])
    by_ids = client.embeddings.create(model=EMBED, input=ids[0])
    lists = client.embeddings.create(model=EMBED, input=ids)
    assert len(one.data) == len(by_ids.data) == 1 and len(lists.data) == 2
    np.testing.assert_allclose(by_ids.data[0].embedding, one.data[0].embedding, atol=1e-6)
    texts = client.embeddings.create(model=EMBED, input=TEXTS[:2])
    np.testing.assert_allclose(
        [d.embedding for d in lists.data], [d.embedding for d in texts.data], atol=1e-6
    )


def test_matryoshka_dimensions(client: Any) -> None:
    full = client.embeddings.create(model=EMBED, input=TEXTS).data
    cut = client.embeddings.create(model=EMBED, input=TEXTS, dimensions=16).data
    for a, b in zip(full, cut, strict=True):
        assert len(a.embedding) == HIDDEN and len(b.embedding) == 16
        head = np.asarray(a.embedding[:16])
        np.testing.assert_allclose(b.embedding, head / np.linalg.norm(head), atol=1e-6)
    same = client.embeddings.create(model=EMBED, input="a", dimensions=HIDDEN)
    assert len(same.data[0].embedding) == HIDDEN
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=EMBED, input="a", dimensions=20)
    body = _error(exc)
    assert body["param"] == "dimensions" and "32, 16" in body["message"]


def test_over_the_limit_is_refused_unless_truncated(client: Any, loaded: LoadedEncoder) -> None:
    long = " ".join(["river"] * (MAX_SEQ_LENGTH + 10))
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=EMBED, input=["a", long])
    body = _error(exc)
    assert body["code"] == "context_length_exceeded" and "input[1]" in body["message"]
    assert f"at most {MAX_SEQ_LENGTH}" in body["message"] and "max_seq_length" in body["message"]
    cut = client.embeddings.create(
        model=EMBED, input=[long], extra_body={"truncate_prompt_tokens": -1}
    )
    np.testing.assert_allclose(
        cut.data[0].embedding, _reference(loaded, [long], MAX_SEQ_LENGTH)[0], atol=1e-6
    )
    assert cut.usage.prompt_tokens == MAX_SEQ_LENGTH
    short = client.embeddings.create(
        model=EMBED, input=[long], extra_body={"truncate_prompt_tokens": 8}
    )
    assert short.usage.prompt_tokens == 8
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=EMBED, input="a", extra_body={"truncate_prompt_tokens": 999})
    assert _error(exc)["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["a"] * 2049}, "input", "at most 2048"),
        ({"input": [[]]}, "input", "no token ids"),
        ({"input": [5, 999999]}, "input", "outside this model's vocabulary"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", ""),
    ],
)
def test_bad_input_shapes(base_url: str, body: dict[str, Any], param: str, words: str) -> None:
    r = post(base_url, "/v1/embeddings", {"model": EMBED, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "")
    assert words in error["message"]


def test_the_token_bound(loaded: LoadedEncoder) -> None:
    roomy = dataclasses.replace(loaded, max_length=512)
    plan = EmbeddingPlan(tuple((7,) * 500 for _ in range(601)), False, None, None)
    with pytest.raises(InvalidRequest, match="300000"):
        tokenize(roomy, plan)


def test_models_serve_only_their_task(client: Any, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=CHAT, input="a")
    body = _error(exc)
    assert body["param"] == "model" and "generates text" in body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=RERANK, input="a")
    assert "/v1/rerank" in _error(exc)["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    body = _error(exc)
    assert body["code"] == "model_not_generative" and "/v1/embeddings" in body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=EMBED, prompt="hi")
    assert _error(exc)["code"] == "model_not_generative"
    r = post(base_url, "/v1/messages", {"model": EMBED, "max_tokens": 5,
             "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error"
    listed = {m.id for m in client.models.list().data}
    assert {CHAT, EMBED, RERANK} <= listed


def _encoder_samples(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("mlx_gateway_encode_")
    }


def test_metrics_count_embedding_and_rerank_requests(
    client: Any, base_url: str, loaded: LoadedEncoder
) -> None:
    before = _encoder_samples(base_url)
    texts = ["metrics count this one", "and this one", "and this one too"]
    got = client.embeddings.create(model=EMBED, input=texts)
    client.embeddings.create(model=EMBED, input=texts)  # from the encoder's recent rows
    r = post(base_url, "/v1/rerank", {"model": RERANK, "query": "q", "documents": ["a", "b c"]})
    assert r.status_code == 200, r.text
    after = _encoder_samples(base_url)

    def grew(name: str, **labels: str) -> float:
        key = (f"mlx_gateway_encode_{name}", tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("requests_total", task="embed", reason="stop") == 2
    assert grew("requests_total", task="rerank", reason="stop") == 1
    assert grew("inputs_total", task="embed") == 6 and grew("inputs_total", task="rerank") == 2
    assert grew("tokens_total", task="embed") == 2 * got.usage.prompt_tokens
    assert grew("cached_tokens_total", task="embed") == got.usage.prompt_tokens
    assert grew("tokens_total", task="rerank") == r.json()["usage"]["total_tokens"]
    assert grew("request_seconds_count", task="embed") == 2
    assert grew("request_seconds_sum", task="embed") > 0
