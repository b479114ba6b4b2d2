"""Tool calling end to end: Qwen2.5-Coder-0.5B through the OpenAI SDK, and a real
agent framework's tool loop, against a live server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

import parsers  # noqa: E402
from gateway.core.models.build import build_served  # noqa: E402
from parsers.events import ToolCallStart  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402

pytestmark = pytest.mark.real_model

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def base_url(qwen25_gguf: Path) -> Iterator[str]:
    with live_server(lambda: build_served(qwen25_gguf, model_id=MODEL)) as url:
        yield url


def _post(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def _stream(base_url: str, body: dict[str, Any]) -> list[ChatCompletionChunk]:
    chunks = []
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(ChatCompletionChunk.model_validate(json.loads(line[5:])))
    return chunks


def _rebuild(chunks: list[ChatCompletionChunk]) -> dict[int, dict[str, str]]:
    """Rebuild tool calls from deltas, checking OpenAI's delta rules on the way."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function and tc.function.name
                assert not calls or tc.index > max(calls), "index only grows"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and (tc.function is None or tc.function.name is None)
            if tc.function and tc.function.arguments:
                calls[tc.index]["arguments"] += tc.function.arguments
    return calls


def test_first_turn_is_a_tool_call_non_streaming(base_url: str) -> None:
    body = ChatCompletion.model_validate(
        _post(base_url, {"model": MODEL, "messages": ASK, "tools": [WEATHER], "temperature": 0})
    )
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert "paris" in args["city"].lower()


def test_first_turn_streams_incremental_arguments(base_url: str) -> None:
    chunks = _stream(
        base_url, {"model": MODEL, "messages": ASK, "tools": [WEATHER], "temperature": 0}
    )
    calls = _rebuild(chunks)
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert "paris" in json.loads(calls[0]["arguments"])["city"].lower()
    fragments = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(fragments) >= 3, "arguments arrive in pieces, not only when the call is complete"
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["tool_calls"]


def test_tool_result_then_text_answer(base_url: str) -> None:
    first = _post(base_url, {"model": MODEL, "messages": ASK, "tools": [WEATHER], "temperature": 0})
    msg = first["choices"][0]["message"]
    call = msg["tool_calls"][0]
    result = {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"}
    # Qwen2.5-Coder-0.5B, greedy, repeats the call when the tool result is the last
    # message; a follow-up user turn (as chat UIs send) gets the text answer.
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": msg["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)},
        {
            "role": "user",
            "content": "Thanks. So, what is the weather in Paris? Answer in a sentence.",
        },
    ]
    body = ChatCompletion.model_validate(
        _post(
            base_url,
            {
                "model": MODEL,
                "messages": history,
                "tools": [WEATHER],
                "temperature": 0,
                "max_tokens": 80,
            },
        )
    )
    answer = body.choices[0].message
    assert body.choices[0].finish_reason == "stop"
    assert not answer.tool_calls and answer.content
    assert "18" in answer.content and "sunny" in answer.content.lower()


def test_tool_choice_required_named_and_none(base_url: str) -> None:
    chat = [{"role": "user", "content": "I am flying to Rome tomorrow."}]
    base = {
        "model": MODEL,
        "messages": chat,
        "tools": [WEATHER],
        "temperature": 0,
        "max_tokens": 40,
    }
    forced = ChatCompletion.model_validate(_post(base_url, {**base, "tool_choice": "required"}))
    assert [c.function.name for c in forced.choices[0].message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
    assert forced.choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_weather"}}
    by_name = ChatCompletion.model_validate(_post(base_url, {**base, "tool_choice": named}))
    (call,) = by_name.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    json.loads(call.function.arguments)  # type: ignore[union-attr]
    none = ChatCompletion.model_validate(_post(base_url, {**base, "tool_choice": "none"}))
    assert not none.choices[0].message.tool_calls and none.choices[0].message.content


def test_openai_agents_tool_loop_completes(base_url: str) -> None:
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool  # type: ignore[untyped-decorator]  # imported via importorskip: Any
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        return f"It is 18 degrees Celsius and sunny in {city}."

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    agent = agents.Agent(
        name="weather",
        instructions="You answer weather questions. Use the get_weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(temperature=0.0, max_tokens=120),
        # the 0.5B model cannot be trusted to stop calling tools: the framework's own
        # loop runs the tool the model asked for and returns its output
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls and "paris" in calls[0].lower()
    assert result.final_output == f"It is 18 degrees Celsius and sunny in {calls[0]}."


READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file from the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "Path of the file"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}
# With this system prompt the greedy 0.5B model answers with a sentence and then the
# call in a ```json fence, as it did for the agent clients (issue 8, section 6).
FENCED_ASK = [
    {
        "role": "system",
        "content": "You are a coding assistant working in a repository. Think step by step "
        "and use tools when needed.",
    },
    {"role": "user", "content": "Read the file hello.txt and tell me what it says."},
]


def test_call_written_in_a_fence_is_a_tool_call(base_url: str) -> None:
    """tool_choice auto: the model's raw reply (the same prompt tokens through
    /v1/completions) is prose plus a ```json fence, no tags; the chat endpoint turns it
    into the sentence as content and a read_file call, streamed by the SDK's rules."""
    tokenized = httpx.post(
        f"{base_url}/tokenize",
        json={"model": MODEL, "messages": FENCED_ASK, "tools": [READ_FILE]},
        timeout=60,
    )
    assert tokenized.status_code == 200, tokenized.text
    raw_body = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": tokenized.json()["tokens"],
            "temperature": 0,
            "max_tokens": 120,
        },
        timeout=300,
    )
    assert raw_body.status_code == 200, raw_body.text
    raw = raw_body.json()["choices"][0]["text"]
    assert "```json" in raw and "<tool_call>" not in raw, raw
    before_fence = raw[: raw.index("```")].strip()

    body = {
        "model": MODEL,
        "messages": FENCED_ASK,
        "tools": [READ_FILE],
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 120,
    }
    chunks = _stream(base_url, body)
    calls = [(c["name"], json.loads(c["arguments"])) for c in _rebuild(chunks).values()]
    assert calls == [("read_file", {"path": "hello.txt"})]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == before_fence and "```" not in content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["tool_calls"]
    # the parser reads the raw text the same way the server did
    parser = parsers.create("qwen2.5", [READ_FILE])
    events = parser.feed(raw) + parser.finish()
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["read_file"]
