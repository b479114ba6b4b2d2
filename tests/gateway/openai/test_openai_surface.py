"""The whole OpenAI surface against a live server with SmolLM2: every chat field in
streaming and non-streaming form, n choices, message shapes, /v1/completions, models,
tokenize, health, metrics and usage. Every body and chunk goes through the SDK's types."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types import Model  # noqa: E402

from gateway.core.models.build import build_served  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.openai_checks import (  # noqa: E402
    chat_body,
    chat_chunks,
    chat_texts,
    completion_body,
    completion_chunks,
    error_of,
    post,
    stream,
)

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Name three colors."}]
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def base_url(smollm2_gguf: Path) -> Iterator[str]:
    with live_server(lambda: build_served(smollm2_gguf, model_id=MODEL)) as url:
        yield url


FIELD_SETS: list[tuple[str, dict[str, Any]]] = [
    ("greedy", {"temperature": 0}),
    ("n=2 seeded", {"n": 2, "temperature": 0.8, "seed": 3}),
    ("max_completion_tokens", {"max_completion_tokens": 3, "max_tokens": 50, "temperature": 0}),
    ("stop", {"stop": ["\n", "."], "temperature": 0}),
    ("logprobs", {"logprobs": True, "top_logprobs": 2, "temperature": 0}),
    ("logit_bias", {"logit_bias": {"28": -100, "29": 5}, "temperature": 0}),
    (
        "penalties",
        {
            "presence_penalty": 1.0,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.2,
            "temperature": 0,
        },
    ),
    ("truncation", {"top_p": 0.9, "top_k": 40, "min_p": 0.05, "temperature": 0.7, "seed": 1}),
    (
        "bookkeeping",
        {
            "user": "u-1",
            "metadata": {"run": "a"},
            "reasoning_effort": "low",
            "service_tier": "auto",
            "chat_template_kwargs": {"enable_thinking": False},
            "prompt_cache_key": "k",
            "store": False,
        },
    ),
    (
        "everything",
        {
            "n": 2,
            "max_completion_tokens": 5,
            "stop": "zzz",
            "seed": 9,
            "logprobs": True,
            "top_logprobs": 1,
            "logit_bias": {"28": 1},
            "presence_penalty": 0.2,
            "frequency_penalty": 0.2,
            "temperature": 0.5,
            "top_p": 0.95,
            "top_k": 50,
            "min_p": 0.01,
            "repetition_penalty": 1.05,
            "user": "u",
            "metadata": {"a": "b"},
            "reasoning_effort": "high",
            "chat_template_kwargs": {"x": 1},
            "parallel_tool_calls": True,
            "tool_choice": "none",
            "response_format": {"type": "text"},
        },
    ),
]


@pytest.mark.parametrize("fields", [f for _, f in FIELD_SETS], ids=[n for n, _ in FIELD_SETS])
def test_chat_fields_non_streaming_and_streaming(base_url: str, fields: dict[str, Any]) -> None:
    req = {"model": MODEL, "messages": HELLO, "max_tokens": 6, **fields}
    n = fields.get("n", 1)
    limit = fields.get("max_completion_tokens", 6)
    body = chat_body(post(base_url, CHAT, req))
    assert [c.index for c in body.choices] == list(range(n))
    assert body.usage is not None and body.usage.completion_tokens <= n * limit
    assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
    assert (
        body.usage.prompt_tokens_details is not None
        and body.usage.completion_tokens_details is not None
    )
    for choice in body.choices:
        assert choice.finish_reason in ("stop", "length")
        if fields.get("logprobs"):
            assert choice.logprobs is not None and choice.logprobs.content
            assert all(
                len(t.top_logprobs) == fields["top_logprobs"] for t in choice.logprobs.content
            )
        else:
            assert choice.logprobs is None
    sse = stream(base_url, CHAT, {**req, "stream_options": {"include_usage": True}})
    chunks = chat_chunks(sse)
    texts = chat_texts(chunks)
    assert sorted(texts) == list(range(n))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == body.usage.prompt_tokens
    if fields.get("temperature") == 0 or "seed" in fields:
        # greedy or seeded: streaming writes exactly what the whole body held
        assert texts == {c.index: c.message.content for c in body.choices}
        assert usage.completion_tokens == body.usage.completion_tokens


def test_predicted_outputs_draft_and_change_nothing(base_url: str) -> None:
    """Predicted Outputs: a reply asked for again with itself as the prediction is the
    same text, streamed or not, and reports the predicted tokens it accepted; a part of
    it wrong is rejected; a prediction of another type is a 400."""
    text = "Write the numbers from one to twenty in words, separated by commas."
    req = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 60,
           "temperature": 0}  # fmt: skip
    plain = chat_body(post(base_url, CHAT, req))
    reply = plain.choices[0].message.content
    assert reply and plain.usage is not None and plain.usage.completion_tokens_details
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    for prediction, right in ((reply, True), (reply[: len(reply) // 2] + " zebra " * 8, False)):
        predicted = {**req, "prediction": {"type": "content", "content": prediction}}
        body = chat_body(post(base_url, CHAT, predicted))
        assert body.choices[0].message.content == reply
        details = body.usage.completion_tokens_details if body.usage else None
        assert details is not None and details.accepted_prediction_tokens
        if right:
            assert details.accepted_prediction_tokens >= plain.usage.completion_tokens - 2
        else:
            assert details.rejected_prediction_tokens
        sse = stream(base_url, CHAT, {**predicted, "stream_options": {"include_usage": True}})
        assert chat_texts(chat_chunks(sse)) == {0: reply}
    parts = {**req, "prediction": {"type": "content", "content": [{"type": "text", "text": reply}]}}
    assert chat_body(post(base_url, CHAT, parts)).choices[0].message.content == reply
    wrong = error_of(post(base_url, CHAT, {**req, "prediction": {"type": "audio", "content": "x"}}),
                     400)  # fmt: skip
    assert wrong["param"] == "prediction.type"


def test_max_tokens_bounds_each_choice(base_url: str) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        body = chat_body(
            post(
                base_url,
                CHAT,
                {"model": MODEL, "messages": HELLO, key: 2, "n": 2, "temperature": 0},
            )
        )
        assert [c.finish_reason for c in body.choices] == ["length", "length"]
        assert body.usage is not None and body.usage.completion_tokens == 4


def test_n_choices_are_seeded_distinct_and_reproducible(base_url: str) -> None:
    req = {"model": MODEL, "messages": HELLO, "max_tokens": 12, "temperature": 1.0, "seed": 11}
    one = chat_body(post(base_url, CHAT, req)).choices[0].message.content
    three = chat_body(post(base_url, CHAT, {**req, "n": 3}))
    again = chat_body(post(base_url, CHAT, {**req, "n": 3}))
    texts = [c.message.content for c in three.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] == one  # choice 0 keeps the request's seed
    assert len(set(texts)) > 1
    # every choice after the first reuses the prompt from the prefix cache
    assert three.usage is not None and three.usage.prompt_tokens_details is not None
    streamed = chat_texts(chat_chunks(stream(base_url, CHAT, {**req, "n": 3})))
    assert [streamed[i] for i in range(3)] == texts


EVERY_SHAPE = [
    {"role": "system", "content": "You are terse."},
    {"role": "developer", "content": [{"type": "text", "text": "Answer in English."}]},
    {"role": "user", "content": "Hi."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is 2+2?"},
            {"type": "text", "text": " Be brief."},
        ],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calc", "arguments": '{"x": "2+2"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "ok"}]},
    {"role": "assistant", "content": "It is 4.", "name": "bot"},
    {"role": "user", "content": "Thanks.", "name": "ann"},
    {"role": "system", "content": "Trailing system note."},
]


def test_every_message_shape_is_served(base_url: str) -> None:
    req = {"model": MODEL, "messages": EVERY_SHAPE, "max_tokens": 4, "temperature": 0}
    body = chat_body(post(base_url, CHAT, req))
    assert body.choices[0].message.role == "assistant"
    assert (
        chat_texts(chat_chunks(stream(base_url, CHAT, req)))[0] == body.choices[0].message.content
    )


def test_image_to_text_only_model_says_no_vision(base_url: str) -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    err = error_of(
        post(base_url, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": content}]}),
        400,
    )
    assert err["code"] == "model_has_no_vision" and "vision" in err["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"unevaluatedProperties": False}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "grammar"}}, "response_format.type"),
        ({"store": True}, "store"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"verbosity": "high"}, "verbosity"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
    ],
)
def test_unhonoured_fields_are_refused_by_name(
    base_url: str, fields: dict[str, Any], param: str
) -> None:
    err = error_of(post(base_url, CHAT, {"model": MODEL, "messages": HELLO, **fields}), 400)
    assert err["param"] == param and param.split("[")[0] in err["message"]


# -- /v1/completions ---------------------------------------------------------------------


def test_completion_string_prompt_stream_and_not(base_url: str) -> None:
    req = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    body = completion_body(post(base_url, TEXT, req))
    assert body.object == "text_completion" and len(body.choices) == 1
    text = body.choices[0].text
    assert body.usage is not None and 0 < body.usage.completion_tokens <= 6
    sse = stream(base_url, TEXT, {**req, "stream_options": {"include_usage": True}})
    chunks = completion_chunks(sse)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [body.choices[0].finish_reason]
    assert (
        chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens == body.usage.completion_tokens
    )


def test_completion_prompts_tokens_echo_and_n(base_url: str) -> None:
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "Once upon a time"}).json()[
        "tokens"
    ]
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    by_text = completion_body(post(base_url, TEXT, {**base, "prompt": "Once upon a time"}))
    by_ids = completion_body(post(base_url, TEXT, {**base, "prompt": tokens}))
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = completion_body(
        post(base_url, TEXT, {**base, "prompt": ["Once upon a time", "Hello"], "n": 2})
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == by_text.choices[0].text
    assert many.usage is not None and by_text.usage is not None
    assert many.usage.prompt_tokens > by_text.usage.prompt_tokens  # both prompts, each once
    echo = completion_body(post(base_url, TEXT, {**base, "prompt": tokens, "echo": True}))
    assert echo.choices[0].text == "Once upon a time" + by_text.choices[0].text
    only = completion_body(
        post(base_url, TEXT, {**base, "prompt": "Echo me", "echo": True, "max_tokens": 0})
    )
    assert (
        only.choices[0].text == "Echo me"
        and only.usage is not None
        and only.usage.completion_tokens == 0
    )
    streamed = completion_chunks(
        stream(base_url, TEXT, {**base, "prompt": "Hi", "echo": True, "n": 2})
    )
    texts: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1] and all(t.startswith("Hi") for t in texts.values())


def test_completion_logprobs_and_best_of(base_url: str) -> None:
    req = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    body = completion_body(post(base_url, TEXT, req))
    lp = body.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    chunks = completion_chunks(stream(base_url, TEXT, req))
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ]
    assert streamed == lp.tokens
    best = completion_body(
        post(
            base_url,
            TEXT,
            {**req, "logprobs": None, "temperature": 1.0, "seed": 5, "n": 1, "best_of": 3},
        )
    )
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage is not None and best.usage.completion_tokens > 4  # all three candidates count


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": [999999]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
        ({"prompt": ["x", "y " * 9000]}, 400, "prompt[1]"),
        ({"prompt": {"a": 1}}, 400, "prompt"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
    ],
)
def test_completion_errors(base_url: str, body: dict[str, Any], status: int, param: str) -> None:
    err = error_of(post(base_url, TEXT, {"model": MODEL, **body}), status)
    assert (err["param"] or "").startswith(param), err


def test_sdk_completions(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, temperature=0, stream=True
        )
        if c.choices
    )
    assert text == out.choices[0].text


# -- models, tokenize, health, metrics -----------------------------------------------------


def test_model_by_id(base_url: str) -> None:
    r = httpx.get(f"{base_url}/v1/models/{MODEL}")
    assert Model.model_validate(r.json()).id == MODEL
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    err = error_of(httpx.get(f"{base_url}/v1/models/org/other-model"), 404)
    assert err["code"] == "model_not_found"


def test_tokenize_and_detokenize(base_url: str) -> None:
    out = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 8192
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": HELLO}).json()
    body = chat_body(post(base_url, CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 1}))
    assert body.usage is not None and chat["count"] == body.usage.prompt_tokens
    error_of(httpx.post(f"{base_url}/detokenize", json={"tokens": [-1]}), 400)
    error_of(httpx.post(f"{base_url}/tokenize", json={}), 400)
    error_of(httpx.post(f"{base_url}/tokenize", json={"prompt": "x", "model": "nope"}), 404)


def test_health_and_metrics(base_url: str) -> None:
    chat_body(post(base_url, CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 2}))
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok" and health["model_loaded"] is True
    assert health["queue_depth"] == 0 and health["model"] == MODEL
    r = httpx.get(f"{base_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in r.text.splitlines()
        if line and not line.startswith("#")
    }
    assert (
        values[
            'mlx_gateway_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}'
        ]
        >= 1
    )
    assert values["mlx_gateway_completion_tokens_total"] >= 2
    assert values["mlx_gateway_prompt_tokens_total"] > 0
    assert values["mlx_gateway_time_to_first_token_seconds_count"] >= 1
    assert "mlx_gateway_queue_depth" in values and "mlx_gateway_prefix_cache_hits_total" in values
    assert "mlx_gateway_decode_tokens_per_second_count" in values


def test_usage_reports_cached_and_reasoning_tokens(base_url: str) -> None:
    req = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief. " * 30}, *HELLO],
        "max_tokens": 3,
        "temperature": 0,
    }
    chat_body(post(base_url, CHAT, req))
    again = chat_body(post(base_url, CHAT, req))
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (
        again.usage.prompt_tokens_details.cached_tokens
        and again.usage.prompt_tokens_details.cached_tokens > 30
    )
    assert again.usage.completion_tokens_details is not None
    assert again.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = chat_chunks(stream(base_url, CHAT, {**req, "stream_options": {"include_usage": True}}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (
        usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens
    )
    text = completion_body(
        post(base_url, TEXT, {"model": MODEL, "prompt": "Be brief. " * 30, "max_tokens": 2})
    )
    assert (
        text.usage is not None
        and text.usage.total_tokens == text.usage.prompt_tokens + text.usage.completion_tokens
    )
