"""The OpenAI SDK against a live server on 127.0.0.1 with a real model.

Every body and chunk is validated with the SDK's own pydantic types; malformed
requests get 4xx errors in OpenAI's shape and the server keeps serving.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types import Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from gateway.core.models.build import build_served  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def base_url(smollm2_gguf: Path) -> Iterator[str]:
    def served() -> Any:
        SERVED[:] = [build_served(smollm2_gguf, model_id=MODEL)]
        return SERVED[0]

    with live_server(served) as url:
        yield url


SERVED: list[Any] = []  # the model behind base_url, for tests that look inside


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _post(base_url: str, body: Any, **kw: Any) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(
        f"{base_url}/v1/chat/completions", content=data, headers=headers, timeout=120, **kw
    )


def _sse_chunks(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        done = False
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            assert not done, "data after [DONE]"
            chunks.append(json.loads(data))
    assert done, "stream did not end with [DONE]"
    return chunks


def test_non_streaming_body_validates(base_url: str) -> None:
    r = _post(base_url, {"model": MODEL, "messages": HELLO, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = ChatCompletion.model_validate(r.json())
    choice = body.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert body.usage is not None and body.usage.completion_tokens <= 12
    assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens


def test_streaming_chunks_validate_and_match_non_streaming(base_url: str) -> None:
    req = {"model": MODEL, "messages": HELLO, "max_tokens": 24, "temperature": 0}
    whole = ChatCompletion.model_validate(_post(base_url, req).json())
    chunks = [
        ChatCompletionChunk.model_validate(c)
        for c in _sse_chunks(
            base_url, {**req, "stream": True, "stream_options": {"include_usage": True}}
        )
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_sdk_streaming_and_non_streaming(client: Any) -> None:
    out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    assert out.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_stop_string_cuts_and_logprobs_validate(base_url: str) -> None:
    req = {"model": MODEL, "messages": HELLO, "max_tokens": 24, "temperature": 0}
    full = _post(base_url, req).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = ChatCompletion.model_validate(_post(base_url, {**req, "stop": [stop]}).json())
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]
    lp = ChatCompletion.model_validate(
        _post(base_url, {**req, "max_tokens": 5, "logprobs": True, "top_logprobs": 3}).json()
    )
    content = lp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == lp.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0.0
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-4  # greedy picks the top


def test_seeded_sampling_is_reproducible(base_url: str) -> None:
    req = {"model": MODEL, "messages": HELLO, "max_tokens": 16, "temperature": 1.0, "seed": 7}
    a = _post(base_url, req).json()["choices"][0]["message"]["content"]
    b = _post(base_url, req).json()["choices"][0]["message"]["content"]
    assert a == b


def test_models_and_health(base_url: str, client: Any) -> None:
    models = httpx.get(f"{base_url}/v1/models").json()
    assert [Model.model_validate(m).id for m in models["data"]] == [MODEL]
    assert [m.id for m in client.models.list()] == [MODEL]
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    ("invalid json", b"{not json", 400, None),
    ("not an object", [1, 2], 400, None),
    ("empty body", b"", 400, None),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "bad role",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
    ),
    ("wrong type", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    (
        "negative max_tokens",
        {"model": MODEL, "messages": HELLO, "max_tokens": -1},
        400,
        "max_tokens",
    ),
    (
        "prompt over the context",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "word " * 9000}],
            "max_tokens": 2,
        },
        400,
        "messages",
    ),
    (
        "temperature too high",
        {"model": MODEL, "messages": HELLO, "temperature": 5},
        400,
        "temperature",
    ),
    (
        "tools",
        {
            "model": MODEL,
            "messages": HELLO,
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        400,
        "tools",
    ),
    (
        "json schema",
        {"model": MODEL, "messages": HELLO, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    (
        "logit_bias out of vocab",
        {"model": MODEL, "messages": HELLO, "logit_bias": {"999999999": 1}},
        400,
        "logit_bias",
    ),
    (
        "image to text model",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                    ],
                }
            ],
        },
        400,
        "messages",
    ),
    ("unknown model", {"model": "gpt-9", "messages": HELLO}, 404, "model"),
    ("missing model", {"messages": HELLO}, 400, "model"),
    ("null messages", {"model": MODEL, "messages": None}, 400, "messages"),
    (
        "content of a wrong type",
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages",
    ),
    (
        "user content null",
        {"model": MODEL, "messages": [{"role": "user", "content": None}]},
        400,
        "messages[0].content",
    ),
    (
        "unknown content part",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "video", "video": {}}]}],
        },
        400,
        "messages[0].content[0]",
    ),
    ("message not an object", {"model": MODEL, "messages": ["hi"]}, 400, "messages"),
    (
        "tool without id",
        {"model": MODEL, "messages": [*HELLO, {"role": "tool", "content": "x"}]},
        400,
        "messages[1].tool_call_id",
    ),
    (
        "bad tool-call arguments",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{oops"},
                        }
                    ],
                },
                *HELLO,
            ],
        },
        400,
        "messages[0].tool_calls[0]",
    ),
    (
        "max_tokens of a wrong type",
        {"model": MODEL, "messages": HELLO, "max_tokens": "ten"},
        400,
        "max_tokens",
    ),
    ("zero max_tokens", {"model": MODEL, "messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    ("n too large", {"model": MODEL, "messages": HELLO, "n": 1000}, 400, "n"),
    ("negative top_k", {"model": MODEL, "messages": HELLO, "top_k": -1}, 400, "top_k"),
    ("top_p zero", {"model": MODEL, "messages": HELLO, "top_p": 0}, 400, "top_p"),
    ("seed of a wrong type", {"model": MODEL, "messages": HELLO, "seed": "x"}, 400, "seed"),
    (
        "too many stops",
        {"model": MODEL, "messages": HELLO, "stop": [str(i) for i in range(17)]},
        400,
        "stop",
    ),
    ("stop of a wrong type", {"model": MODEL, "messages": HELLO, "stop": 5}, 400, "stop"),
    (
        "metadata of a wrong type",
        {"model": MODEL, "messages": HELLO, "metadata": {"k": 1}},
        400,
        "metadata",
    ),
    (
        "top_logprobs too large",
        {"model": MODEL, "messages": HELLO, "top_logprobs": 30, "logprobs": True},
        400,
        "top_logprobs",
    ),
    (
        "NaN temperature",
        b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        None,
    ),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, 400, None),
    (
        "a 5000-digit number",
        b'{"model": "smollm2-135m", "max_tokens": 1' + b"0" * 5000 + b"}",
        400,
        None,
    ),
    (
        "lone surrogate",
        b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "messages[0].content",
    ),
    (
        "invalid utf-8",
        b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff"}]}',
        400,
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "param"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_malformed_requests_get_openai_errors(
    base_url: str, name: str, body: Any, status: int, param: str | None
) -> None:
    r = _post(base_url, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert (err["param"] or "").startswith(param), err
    if name == "prompt over the context":  # a huge max_tokens is clamped, not refused
        assert err["code"] == "context_length_exceeded" and "tokens over" in err["message"]
    ok = _post(base_url, {"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert ok.status_code == 200


def test_unknown_route_and_method(base_url: str) -> None:
    assert httpx.get(f"{base_url}/v1/nope").json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{base_url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_sdk_raises_typed_errors(client: Any) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def test_prefix_cache_reuses_a_conversation(base_url: str) -> None:
    system = {"role": "system", "content": "You are a terse assistant. " * 20}
    first = [system, {"role": "user", "content": "List two fruits."}]
    req = {"model": MODEL, "messages": first, "max_tokens": 12, "temperature": 0}
    a = ChatCompletion.model_validate(_post(base_url, req).json())
    again = ChatCompletion.model_validate(_post(base_url, req).json())
    assert again.choices[0].message.content == a.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert again.usage.prompt_tokens - 8 <= cached < again.usage.prompt_tokens
    turn2 = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "One more."},
    ]
    b = ChatCompletion.model_validate(_post(base_url, {**req, "messages": turn2}).json())
    assert b.usage is not None and b.usage.prompt_tokens_details is not None and a.usage is not None
    assert (b.usage.prompt_tokens_details.cached_tokens or 0) >= a.usage.prompt_tokens - 8
    dump = httpx.get(f"{base_url}/debug/prefix-cache").json()
    assert dump["stats"]["hits"] >= 2 and dump["trie"] and not dump["busy"]


def test_prefix_cache_view_answers_while_a_request_runs(base_url: str) -> None:
    _post(base_url, {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0})
    settled = httpx.get(f"{base_url}/debug/prefix-cache").json()
    runner = SERVED[0].runner
    with runner.lock:  # as the engine holds it while a request runs
        busy = httpx.get(f"{base_url}/debug/prefix-cache", timeout=10).json()
    assert busy["busy"] and busy["as_of"] <= settled["as_of"]
    # the view taken when the last request finished
    assert busy["stats"] == settled["stats"] and busy["trie"] == settled["trie"]
    assert busy["recent"] == settled["recent"]


FUZZ_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    2,
    10**20,
    0.5,
    -0.5,
    1e308,
    "",
    "x",
    "\u0000",
    [],
    {},
    [1],
    ["a"],
    {"a": 1},
    [[1]],
    [{"type": "text", "text": "hi"}],
    [{"type": "text"}],
    [{"type": "weird"}],
]
FUZZ_FIELDS = [
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "n",
    "stop",
    "seed",
    "user",
    "metadata",
    "store",
    "tools",
    "tool_choice",
    "response_format",
    "reasoning_effort",
    "chat_template_kwargs",
    "prompt",
    "echo",
    "best_of",
    "suffix",
    "tokens",
]


def _fuzz_body(rng: random.Random) -> dict[str, Any]:
    roles = ["system", "developer", "user", "user", "assistant", "tool", "wizard"]
    contents: list[Any] = [
        "hi",
        "hi",
        None,
        "",
        [{"type": "text", "text": "a"}],
        5,
        [{"type": "x"}],
    ]
    messages = [
        {
            "role": rng.choice(roles),
            "content": rng.choice(contents),
            "tool_call_id": rng.choice([None, "c"]),
        }
        for _ in range(rng.randint(0, 3))
    ]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "prompt": "hi", "max_tokens": 2}
    for field in FUZZ_FIELDS:
        if rng.random() < 0.06:
            body[field] = rng.choice(FUZZ_VALUES)
    for field, cap in (("max_tokens", 2), ("max_completion_tokens", 2), ("n", 2), ("best_of", 2)):
        if isinstance(body.get(field), int) and body[field] > cap:
            body[field] = cap  # keep the ones that generate cheap
    return body


def test_random_bodies_never_hurt_the_server(base_url: str) -> None:
    rng = random.Random(1234)
    paths = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
    for _ in range(120):
        path = rng.choice(paths)
        r = httpx.post(f"{base_url}{path}", json=_fuzz_body(rng), timeout=120)
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            assert r.json()["error"]["message"]
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok" and health["queue_depth"] == 0
    assert _post(base_url, {"model": MODEL, "messages": HELLO, "max_tokens": 2}).status_code == 200
