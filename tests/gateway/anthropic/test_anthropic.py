"""Anthropic Messages API against a live server, with the Anthropic SDK (its client
and its types) as the oracle for every body and streamed event.

Wire behaviour runs on the tiny random Qwen3 (the real tokenizer and template, so
Claude Code's 27k-token requests prefill in about a second; its output is noise, so
greedy decoding makes it reproducible); a real tool round trip runs on
Qwen2.5-Coder-0.5B. Adapter and emitter units are in test_anthropic_units.py.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from gateway.anthropic import adapt, wire
from gateway.anthropic.routes import prepare_messages
from gateway.core.models.build import build_served
from gateway.core.settings import EngineSettings, ServerSettings
from tests.support.anthropic_checks import (
    HELLO,
    MODEL,
    TIMEOUT,
    WEATHER,
    check_blocks,
    check_error,
    check_message,
    check_stream,
    read_events,
)
from tests.support.live_server import live_server

KEY = "test-key"
AUTH = {"x-api-key": KEY}
# SDK 2.12 has no sampling parameters; clients that still send them are honoured
GREEDY: Any = {"temperature": 0}
ENV = "MLX_GATEWAY_CLIENT_FIXTURES"
FIXTURES = [
    "claude_code_first_request",
    "claude_code_first_request_custom_model",
    "claude_code_first_request_default_model",
    "claude_code_tool_result_request",
    "claude_code_tool_result_request_custom_model",
    "openclaw_first_request_anthropic",
]
BILLING = "x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch={};"


def _fixture(name: str) -> dict[str, Any]:
    """A captured request from shared/fixtures/clients (in the checkout, next to it, or
    in the folder named by $ENV)."""
    root = Path(__file__).resolve().parents[3]
    candidates = [Path(os.environ[ENV])] if os.environ.get(ENV) else []
    candidates += [root / "shared/fixtures/clients", root.parent / "shared/fixtures/clients"]
    for folder in candidates:
        if (folder / f"{name}.json").is_file():
            data: dict[str, Any] = json.loads((folder / f"{name}.json").read_text())
            return data
    pytest.skip(f"no captured client requests (set {ENV} to shared/fixtures/clients)")


def _with_billing(body: dict[str, Any], cch: int) -> dict[str, Any]:
    """The request as Claude Code sends it with attribution on: a billing line first."""
    header = {"type": "text", "text": BILLING.format(cch)}
    return {**body, "system": [header, *body["system"]]}


@pytest.fixture(scope="module")
def base_url(tiny_qwen3_dir: Path) -> Iterator[str]:
    # a short keepalive, so a prefill of a few thousand tokens already sees pings
    settings = ServerSettings(api_key=KEY, keepalive_seconds=0.1)
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=MODEL), settings) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=TIMEOUT)


def _post(base_url: str, body: Any, path: str = "/v1/messages", **headers: str) -> httpx.Response:
    sent = {"content-type": "application/json", **AUTH, **headers}
    data = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{base_url}{path}", content=data, headers=sent, timeout=TIMEOUT)


def _text(msg: anthropic.types.Message) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


# -- text, streamed and not ----------------------------------------------------------------


def test_sdk_non_streaming_and_streaming(client: anthropic.Anthropic, base_url: str) -> None:
    msg = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY)
    check_blocks(msg)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 8
    assert [b.type for b in msg.content] == ["text"] and msg.model == MODEL
    raw = check_message(
        _post(
            base_url, {"model": MODEL, "max_tokens": 8, "messages": HELLO, "temperature": 0}
        ).json()
    )
    assert _text(raw) == _text(msg)  # greedy: the same text again
    with client.messages.stream(
        model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == _text(final) == _text(msg)
    assert final.stop_reason == "max_tokens" and final.id.startswith("msg_")


def test_stream_has_named_events_on_the_beta_path(base_url: str) -> None:
    body = {"model": MODEL, "max_tokens": 6, "messages": HELLO, "temperature": 0}
    headers = {**AUTH, "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking"}
    events = read_events(base_url, body, headers, path="/v1/messages?beta=true")
    msg = check_stream(events)
    start = events.named("message_start")[0]["message"]
    assert start["usage"]["input_tokens"] == msg.usage.input_tokens + (
        msg.usage.cache_read_input_tokens or 0
    )
    assert msg.usage.output_tokens == 6 and msg.stop_reason == "max_tokens"


def test_stop_sequence_reports_the_matched_string(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body=GREEDY)
    text = _text(free)
    assert free.stop_reason == "max_tokens" and len(text) > 4
    stop = text[2:4]  # greedy: the same text comes again, and stops inside it
    msg = client.messages.create(
        model=MODEL,
        max_tokens=16,
        messages=HELLO,
        stop_sequences=["never-generated-stop", stop],
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert _text(msg) == text[: text.index(stop)]
    assert msg.usage.output_tokens < free.usage.output_tokens


def test_max_tokens_zero_warms_the_cache(client: anthropic.Anthropic) -> None:
    words: Any = [{"role": "user", "content": "warm me up: " + "lorem ipsum " * 200}]
    warm = client.messages.create(model=MODEL, max_tokens=0, messages=words)
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0
    again = client.messages.create(model=MODEL, max_tokens=2, messages=words)
    assert (again.usage.cache_read_input_tokens or 0) > 400


def test_usage_and_count_tokens_agree(client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "system": [
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
    }
    counted = client.messages.count_tokens(**body).input_tokens
    first = client.messages.create(max_tokens=3, **body)
    second = client.messages.create(max_tokens=3, **body)
    for msg in (first, second):
        usage = msg.usage
        total = usage.input_tokens + (usage.cache_read_input_tokens or 0)
        assert total + (usage.cache_creation_input_tokens or 0) == counted
    assert (second.usage.cache_read_input_tokens or 0) > counted // 2
    assert second.usage.input_tokens < first.usage.input_tokens


def test_pings_keep_a_stream_alive(base_url: str) -> None:
    # a new ~29k-token conversation and 300 tokens of output: longer than the 0.1 s
    # keepalive even on a fast machine
    prompt = "fresh " + " ".join(f"w{i}" for i in range(6000))
    body = {"model": MODEL, "max_tokens": 300, "messages": [{"role": "user", "content": prompt}]}
    events = read_events(base_url, body, AUTH)
    check_stream(events)
    assert "ping" in events.names


# -- thinking ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_url(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny Qwen3 with a Qwen3-Thinking-style template: the generation prompt opens
    `<think>`, so its output lands in reasoning."""
    out = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    for item in tiny_qwen3_dir.iterdir():
        shutil.copy(item, out / item.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    closing = "{%- endif %}\n{%- endif %}"
    assert config["chat_template"].endswith(closing)
    opened = "{%- else %}\n        {{- '<think>\\n' }}\n    " + closing
    config["chat_template"] = config["chat_template"][: -len(closing)] + opened
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    with live_server(lambda: build_served(out, model_id=MODEL)) as url:
        yield url


def test_thinking_blocks_streamed_and_not(thinking_url: str) -> None:
    client = anthropic.Anthropic(base_url=thinking_url, api_key="x", max_retries=0)
    think: Any = {"type": "enabled", "budget_tokens": 7}
    msg = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, thinking=think)
    check_message(msg.model_dump())
    assert [b.type for b in msg.content] == ["thinking"]
    events = read_events(
        thinking_url, {"model": MODEL, "max_tokens": 8, "messages": HELLO, "thinking": think}
    )
    streamed = check_stream(events)
    check_blocks(streamed)
    deltas = [e["delta"]["type"] for e in events.named("content_block_delta")]
    assert deltas[-1] == "signature_delta" and set(deltas[:-1]) == {"thinking_delta"}
    # the thinking comes back in the next turn (with a redacted block from elsewhere)
    history: Any = [
        *HELLO,
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
                *[b.model_dump(exclude_none=True) for b in streamed.content],
                {"type": "text", "text": "Hello!"},
            ],
        },
        {"role": "user", "content": "and now?"},
    ]
    off = client.messages.create(
        model=MODEL, max_tokens=4, messages=history, thinking={"type": "disabled"}
    )
    assert off.content and all(b.type == "text" for b in off.content)


def test_thinking_budget_closes_the_reasoning_block(thinking_url: str) -> None:
    # the tiny model reasons for all of max_tokens unless the block is closed for it (the
    # sampler tests count the budget's tokens exactly)
    client = anthropic.Anthropic(base_url=thinking_url, api_key="x", max_retries=0)
    think: Any = {"type": "enabled", "budget_tokens": 3}
    for _ in range(3):
        msg = client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, thinking=think)
        check_message(msg.model_dump())
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.usage.output_tokens == 24
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(
            model=MODEL,
            max_tokens=24,
            messages=HELLO,
            thinking={"type": "enabled", "budget_tokens": 0},
        )


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": HELLO}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"max_tokens": 5, "messages": HELLO, "temperature": 3}, "temperature"),
        (
            {"max_tokens": 5, "messages": HELLO, "mcp_servers": [{"type": "url", "url": "u"}]},
            "mcp_servers",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "search_result", "source": "s", "title": "t", "content": []}
                        ],
                    }
                ],
            },
            "search_result",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "iVBORw0K",
                                },
                            }
                        ],
                    }
                ],
            },
            "vision",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                            {"type": "text", "text": "what is it?"},
                        ],
                    }
                ],
            },
            "vision",
        ),
    ],
)
def test_bad_input_is_an_anthropic_400(base_url: str, body: dict[str, Any], says: str) -> None:
    r = _post(base_url, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert says in check_error(r.json(), "invalid_request_error")


def test_images_refused_on_count_tokens_and_by_the_sdk(client: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
    content: Any = [image, {"type": "text", "text": "?"}]
    with pytest.raises(anthropic.BadRequestError, match="vision"):
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": content}])
    with pytest.raises(anthropic.BadRequestError, match="vision"):
        client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}]
        )


def test_not_json_and_prompt_too_long(base_url: str) -> None:
    r = _post(base_url, "{not json")
    assert r.status_code == 400 and "JSON" in check_error(r.json(), "invalid_request_error")
    long = {
        "model": MODEL,
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi " * 70000}],
    }
    r = _post(base_url, long)
    assert r.status_code == 400
    message = check_error(r.json(), "invalid_request_error")
    assert message.startswith("prompt is too long:") and "tokens over" in message


def test_auth_and_unknown_model(base_url: str) -> None:
    body: Any = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
    r = httpx.post(f"{base_url}/v1/messages", json=body, timeout=TIMEOUT)
    assert r.status_code == 401 and check_error(r.json(), "authentication_error")
    r = httpx.post(f"{base_url}/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and check_error(r.json(), "authentication_error")
    bearer = {"authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{base_url}/v1/messages", json=body, headers=bearer, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(
            **body
        )
    r = _post(base_url, {**body, "model": "claude-sonnet-4-5"})
    assert r.status_code == 404
    assert "claude-sonnet-4-5" in check_error(r.json(), "not_found_error")
    r = _post(base_url, {**body, "model": "nope"}, path="/v1/messages/count_tokens")
    assert r.status_code == 404 and check_error(r.json(), "not_found_error")


def test_root_answers_probes(base_url: str) -> None:
    for path in ("/", "/api/hello"):
        assert httpx.get(f"{base_url}{path}", headers=AUTH).status_code == 200
        assert httpx.head(f"{base_url}{path}", headers=AUTH).status_code == 200


# -- the real clients' requests ------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_captured_requests_replay(base_url: str, name: str) -> None:
    body = {**_fixture(name), "model": MODEL, "max_tokens": 8}
    counted = _post(base_url, body, path="/v1/messages/count_tokens")
    assert counted.status_code == 200, counted.text
    events = read_events(base_url, body, AUTH)
    msg = check_stream(events)
    check_blocks(msg)
    usage = msg.usage
    assert (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.json()["input_tokens"]
    )


def _prompt_tokens(served: Any, body: dict[str, Any]) -> list[int]:
    plan = adapt.chat_plan(wire.MessagesRequest.model_validate(body), tools_supported=True)
    return prepare_messages(served, plan).tokens


def test_billing_header_leaves_the_shared_prefix_whole(tiny_qwen3_dir: Path, base_url: str) -> None:
    """Two consecutive Claude Code requests, each with its own attribution line: the
    second's prompt extends the first's, so the cache serves nearly all of it."""
    # a conversation no other test sent: the cache holds none of it before
    fresh = {"type": "text", "text": f"Session {os.getpid()}-{id(base_url)}."}
    first, second = (
        _fixture(n) for n in ("claude_code_first_request", "claude_code_tool_result_request")
    )
    first = _with_billing({**first, "system": [fresh, *first["system"]]}, 1111)
    second = _with_billing({**second, "system": [fresh, *second["system"]]}, 2222)
    served = build_served(tiny_qwen3_dir, model_id=MODEL)
    a, b = _prompt_tokens(served, first), _prompt_tokens(served, second)
    common = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    # they differ only in the last user text ("say hi" / "read hello.txt") onwards
    assert len(a) - common <= 16, (len(a), common)
    assert "billing-header" not in served.loaded.tokenizer.decode(a)
    for body in (first, second):
        events = read_events(base_url, {**body, "model": MODEL, "max_tokens": 1}, AUTH)
        cached = check_stream(events).usage.cache_read_input_tokens or 0
    assert common - 64 <= cached <= common


def test_late_system_turns_fold_for_templates_that_refuse_them(tiny_qwen3_dir: Path) -> None:
    """Qwen3.5's template accepts a system message only first; Claude Code sends one
    after the first user turn."""
    body = {**_fixture("claude_code_tool_result_request_custom_model"), "model": MODEL}
    settings = EngineSettings(template_family="qwen3.5")
    served = build_served(tiny_qwen3_dir, model_id=MODEL, settings=settings)
    tokens = _prompt_tokens(served, body)
    text = served.loaded.tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.count("<|im_start|>system") == 1
    assert "<|im_start|>user\n<system-reminder>\nAvailable agent types" not in text
    assert "</system-reminder>\n\nread hello.txt\n<system-reminder>\nAvailable agent" in text


# -- a real tool round trip ----------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_client(qwen25_gguf: Path) -> Iterator[anthropic.Anthropic]:
    with live_server(lambda: build_served(qwen25_gguf, model_id="qwen")) as url:
        yield anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=TIMEOUT)


ASK: Any = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.mark.real_model
def test_tool_round_trip_with_qwen25(qwen_client: anthropic.Anthropic) -> None:
    first = qwen_client.messages.create(
        model="qwen",
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    check_message(first.model_dump())
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and "paris" in str(call.input.get("city", "")).lower()
    history: Any = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": "18 degrees Celsius and sunny",
                },
                # after a bare result the 0.5B model (greedy) calls again; a question
                # after it, in the same turn, gets it to answer
                {"type": "text", "text": "Thanks. So, what is the weather? Answer in a sentence."},
            ],
        },
    ]
    answer = qwen_client.messages.create(
        model="qwen",
        max_tokens=60,
        messages=history,
        tools=[WEATHER],
        extra_body=GREEDY,
    )
    check_message(answer.model_dump())
    assert answer.stop_reason == "end_turn", answer
    assert "18" in _text(answer)


@pytest.mark.real_model
def test_streamed_tool_use_with_qwen25(qwen_client: anthropic.Anthropic) -> None:
    with qwen_client.messages.stream(
        model="qwen",
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in kinds
    assert final.stop_reason == "tool_use"
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and "paris" in json.dumps(call.input).lower()
