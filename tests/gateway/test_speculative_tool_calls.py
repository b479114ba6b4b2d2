"""Speculative decoding across a tool-call opener: Qwen2.5-Coder-0.5B (hermes
`<tool_call>` calls) asked the same thing with a prediction that goes wrong inside the
call it writes (another tool's name, other arguments, a second call after it) or that
opens a call where it answers in text. Each reply, streamed or not, is the one written
with no speculation at all: the same content, tool calls (names and arguments), finish
reason and token count, the stream's deltas in the same order; no call is invented and
none is lost. Two servers share the weights: speculation off (the reference), and the
default prompt lookup; every predicted request drafted and kept part of its draft, and
most of them had a draft rejected (the server's counters), so a drafter that never
drafts cannot pass."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.core.models.build import build_served
from gateway.core.settings import EngineSettings
from tests.support.live_server import live_server
from tests.support.openai_checks import chat_body, chat_chunks, post, stream
from tests.support.speculative_checks import (
    Drafts,
    anthropic_message,
    chat_trace,
    drafts,
    pin_draft_costs,
)

pytestmark = pytest.mark.real_model

MODEL = "qwen2.5-coder-0.5b"
CHAT = "/v1/chat/completions"


def _tool(name: str, description: str, **properties: Any) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": ["city"]}
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": params}}  # fmt: skip


CITY = {"type": "string", "description": "City name, e.g. Paris"}
TOOLS = [
    _tool("get_weather", "Get the current weather for a city.", city=CITY,
          unit={"type": "string", "enum": ["celsius", "fahrenheit"]}),
    _tool("get_time", "Get the local time in a city.", city=CITY),
]  # fmt: skip
ASKS = {
    "calls": "What is the weather like in Paris right now?",  # greedy: get_weather(Paris)
    "answers": "Hi! Who are you?",  # greedy: two sentences of text, no call
}
OTHER_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def urls(qwen25_gguf: Path) -> Iterator[tuple[str, str]]:
    """(speculation off, prompt lookup): two engines over one loaded model."""
    plain = build_served(qwen25_gguf, model_id=MODEL, settings=EngineSettings(speculative="off"))
    drafting = build_served(qwen25_gguf, model_id=MODEL, loaded=plain.loaded)
    pin_draft_costs(drafting)
    with live_server(lambda: plain) as off, live_server(lambda: drafting) as lookup:
        yield off, lookup


def _body(ask: str) -> dict[str, Any]:
    return {
        "model": MODEL, "messages": [{"role": "user", "content": ask}], "tools": TOOLS,
        "max_tokens": 80, "temperature": 0, "stream_options": {"include_usage": True},
    }  # fmt: skip


def _chat(base_url: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The whole reply (message with call ids left out, finish reason, completion
    tokens) and the stream's trace."""
    done = chat_body(post(base_url, CHAT, {k: v for k, v in body.items() if k != "stream_options"}))
    choice = done.choices[0]
    assert done.usage is not None
    message = choice.message.model_dump(exclude_none=True)
    for call in message.get("tool_calls", []):
        assert call.pop("id")
    whole = {"message": message, "finish_reason": choice.finish_reason,
             "completion_tokens": done.usage.completion_tokens}  # fmt: skip
    return whole, chat_trace(chat_chunks(stream(base_url, CHAT, body)))


@pytest.fixture(scope="module")
def references(urls: tuple[str, str]) -> dict[str, tuple[dict[str, Any], Any]]:
    out = {name: _chat(urls[0], _body(ask)) for name, ask in ASKS.items()}
    calls = out["calls"][0]
    assert calls["finish_reason"] == "tool_calls"
    (call,) = calls["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] == "Paris"
    answers = out["answers"][0]
    assert answers["finish_reason"] == "stop" and "tool_calls" not in answers["message"]
    assert answers["message"]["content"].count(". ") == 1  # two sentences
    return out


def _written_call(whole: dict[str, Any]) -> str:
    """The hermes text of the reference's call, as the model wrote it."""
    (call,) = whole["message"]["tool_calls"]
    function = call["function"]
    return (f'<tool_call>\n{{"name": "{function["name"]}", '
            f'"arguments": {function["arguments"]}}}\n</tool_call>')  # fmt: skip


def _predictions(references: dict[str, tuple[dict[str, Any], Any]]) -> dict[str, tuple[str, str]]:
    """(the ask, the prediction) for each way a draft crosses a call's opener wrongly."""
    call = _written_call(references["calls"][0])
    text = references["answers"][0]["message"]["content"]
    first = text[: text.index(". ") + 1]
    return {
        # drafted: the opener and `{"name": "get_`, then `time` where the model writes `weather`
        "other-name": ("calls", call.replace("get_weather", "get_time")),
        # drafted: the call up to the city, then `London` where the model writes `Paris`
        "other-arguments": ("calls", call.replace("Paris", "London")),
        # drafted: the whole call, then a second opener where the model ends its turn
        "second-call": ("calls", f"{call}\n{OTHER_CALL}"),
        # drafted: the first sentence, then an opener where the model writes on
        "opener-mid-answer": ("answers", f"{first}\n{OTHER_CALL}"),
        # drafted: the answer, then an opener where the model ends its turn
        "opener-after-answer": ("answers", f"{text}{OTHER_CALL}"),
    }


def test_a_prediction_crossing_a_tool_call_opener_changes_nothing(
    urls: tuple[str, str], references: dict[str, tuple[dict[str, Any], Any]]
) -> None:
    lookup = urls[1]
    cases = _predictions(references)
    spent: dict[str, Drafts] = {}
    for name, (ask, prediction) in cases.items():
        body = {**_body(ASKS[ask]), "prediction": {"type": "content", "content": prediction}}
        before = drafts(lookup)
        whole, trace = _chat(lookup, body)
        spent[name] = drafts(lookup) - before
        assert whole == references[ask][0], name
        assert trace == references[ask][1], name
        assert spent[name].accepted > 0, (name, spent[name])
    rejecting = [name for name, d in spent.items() if d.rejected > 0]
    assert len(rejecting) > len(cases) // 2, spent


# Anthropic Messages has no prediction: the earlier call in the conversation is what
# prompt lookup drafts the next one from, and it goes wrong at the city
HISTORY: Any = [
    {"role": "user", "content": ASKS["calls"]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris", "unit": "celsius"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 degrees, sunny"},
        {"type": "text", "text": "And what is the weather like in London?"},
    ]},
]  # fmt: skip


def test_lookup_drafting_a_call_from_an_earlier_one_changes_nothing(
    urls: tuple[str, str],
) -> None:
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    # greedy, the model calls for London again and again: the first call is the one
    # drafted from the Paris call (a second one, refused, is written as text)
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "messages": HISTORY,
            "tools": tools, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}  # fmt: skip
    off, lookup = urls
    whole, trace, none = anthropic_message(off, body)
    assert none == Drafts(0, 0)
    first = whole["content"][0]
    assert first["type"] == "tool_use", whole
    assert (first["name"], first["input"]["city"]) == ("get_weather", "London")
    drafted_whole, drafted_trace, spent = anthropic_message(lookup, body)
    assert drafted_whole == whole
    assert drafted_trace == trace
    assert spent.accepted > 0 and spent.rejected > 0, spent
