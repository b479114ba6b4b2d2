"""Anthropic Messages API without a server: the adapter (wire -> plan), the emitter
(parser events -> events and bodies, checked with the Anthropic SDK's own types), and
the stop matcher reporting which stop sequence ended a reply."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types import Message

from gateway.anthropic import adapt, wire
from gateway.anthropic.emit import (
    MessageOutput,
    signature,
    stop_event,
    thinking_from_signature,
)
from gateway.anthropic.routes import error_events
from gateway.core.errors import InternalError, InvalidRequest
from parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart
from runtime.text.stops import StopMatcher
from runtime.types import Finished, FinishReason, GenerationStats
from templates.types import ImagePart, TextPart
from tests.support.anthropic_checks import (
    HELLO,
    MODEL,
    WEATHER,
    Events,
    check_error,
    check_message,
    check_stream,
)

BILLING = "x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch={};"


def _request(**body: Any) -> wire.MessagesRequest:
    return wire.MessagesRequest.model_validate({"model": MODEL, "max_tokens": 16, **body})


def _plan(**body: Any) -> Any:
    return adapt.chat_plan(_request(**body), tools_supported=True)


# -- the stop matcher reports which stop string ended the text ---------------------------


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize(
    ("text", "stops", "kept", "matched"),
    [
        ("hello world", ["wor", "o"], "hell", "o"),
        ("say abc now", ["bc", "abc"], "say ", "abc"),
        ("xyz", ["q"], "xyz", None),
        ("one two", ["two", "ne t"], "o", "ne t"),
    ],
)
def test_stop_matcher_reports_the_matched_stop(
    chunk: int, text: str, stops: list[str], kept: str, matched: str | None
) -> None:
    m = StopMatcher(stops)
    out = []
    for i in range(0, len(text), chunk):
        piece, hit = m.feed(text[i : i + chunk])
        out.append(piece)
        if hit:
            break
    else:
        out.append(m.flush())
    assert "".join(out) == kept
    assert m.matched == matched


# -- adapter -------------------------------------------------------------------------------


def test_tool_results_and_text_split_into_tool_and_user_messages() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "P"}}
    call2 = {**call, "id": "toolu_2"}
    plan = _plan(
        system=[{"type": "text", "text": "be brief"}, {"type": "text", "text": "really"}],
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}, call, call2]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no such city"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    )
    roles = [m.role for m in plan.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    assert plan.messages[0].content == "be brief\nreally"
    assistant = plan.messages[2]
    assert [c.id for c in assistant.tool_calls] == ["toolu_1", "toolu_2"]
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "P"}
    assert plan.messages[3].tool_call_id == "toolu_1" and plan.messages[3].content == "sunny"
    error = plan.messages[4].content
    assert isinstance(error, str) and error.startswith("Error") and "no such city" in error
    assert plan.messages[5].content == "thanks"


def test_images_become_image_parts() -> None:
    plan = _plan(
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ]
    )
    content = plan.messages[0].content
    assert content == (
        ImagePart("data:image/png;base64,AAAA"),
        ImagePart("https://x/y.png"),
        TextPart("what is this?"),
    )


def _thinking_history() -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = [{"role": "user", "content": "q0"}]
    for n in range(3):
        thought = f"thought {n}"
        turns.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "thinking", "thinking": thought, "signature": signature(thought)},
                    {"type": "text", "text": f"answer {n}"},
                ],
            }
        )
        turns.append({"role": "user", "content": f"q{n + 1}"})
    return turns


@pytest.mark.parametrize(
    ("edits", "kept"),
    [
        (None, ["thought 0", "thought 1", "thought 2"]),
        (
            [{"type": "clear_thinking_20251015", "keep": "all"}],
            ["thought 0", "thought 1", "thought 2"],
        ),
        ([{"type": "clear_thinking_20251015"}], [None, None, "thought 2"]),
        (
            [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}],
            [None, "thought 1", "thought 2"],
        ),
        (
            [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}],
            [None, None, None],
        ),
    ],
)
def test_clear_thinking_keeps_the_latest_turns(
    edits: list[dict[str, Any]] | None, kept: list[str | None]
) -> None:
    extra = {"context_management": {"edits": edits}} if edits is not None else {}
    plan = _plan(messages=_thinking_history(), **extra)
    assistants = [m for m in plan.messages if m.role == "assistant"]
    assert [m.reasoning for m in assistants] == kept
    assert [m.content for m in assistants] == ["answer 0", "answer 1", "answer 2"]


def test_signature_carries_the_thinking_text() -> None:
    text = "let me think about ünïcode\nand lines"
    sig = signature(text)
    assert sig == signature(text) and thinking_from_signature(sig) == text
    assert thinking_from_signature(sig[:-2] + "00") is None
    assert thinking_from_signature("EqQBCkYIARgCIkD-anthropic-signature") is None
    # a client that omits the text still sends it back inside the signature
    plan = _plan(
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "", "signature": sig},
                    {"type": "text", "text": "a"},
                ],
            },
            {"role": "user", "content": "q2"},
        ]
    )
    assert plan.messages[1].reasoning == text


@pytest.mark.parametrize(
    ("body", "choice", "name", "parallel"),
    [
        ({}, "auto", None, True),
        ({"tool_choice": {"type": "auto"}}, "auto", None, True),
        ({"tool_choice": {"type": "any"}}, "required", None, True),
        ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "named", "get_weather", True),
        ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "auto", None, False),
    ],
)
def test_tool_choice(body: dict[str, Any], choice: str, name: str | None, parallel: bool) -> None:
    hosted = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    plan = _plan(messages=HELLO, tools=[WEATHER, hosted], **body)
    assert [t.name for t in plan.tools.tools] == ["get_weather"]  # the hosted tool left out
    assert (plan.tools.choice, plan.tools.name, plan.tools.parallel) == (choice, name, parallel)
    assert not _plan(messages=HELLO, tools=[WEATHER], tool_choice={"type": "none"}).tools.tools


@pytest.mark.parametrize(
    ("body", "enable", "effort"),
    [
        ({}, None, None),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, True, None),
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}}, True, "high"),
        ({"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}, False, None),
        ({"output_config": {"effort": "low"}}, None, "low"),
    ],
)
def test_thinking_and_effort(body: dict[str, Any], enable: bool | None, effort: str | None) -> None:
    options = _plan(messages=HELLO, **body).options
    assert (options.enable_thinking, options.reasoning_effort) == (enable, effort)


def test_sampling_fields_win_over_model_defaults() -> None:
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    sent = adapt.chat_plan(
        _request(messages=HELLO, temperature=0.2, top_k=5), tools_supported=True, defaults=defaults
    )
    assert (sent.sampling.temperature, sent.sampling.top_p, sent.sampling.top_k) == (0.2, 0.8, 5)


def test_cache_control_pins_the_prefix() -> None:
    assert _plan(messages=HELLO).pin is None
    five = _plan(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
            }
        ]
    )
    assert five.pin is not None and five.pin.ttl == 300
    hour = _plan(messages=HELLO, cache_control={"type": "ephemeral", "ttl": "1h"})
    assert hour.pin is not None and hour.pin.ttl == 3600


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"propertyNames": {}}}}},
            "propertyNames",
        ),
        ({"output_config": {"format": {"type": "text"}}}, "output_config.format.type"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "nope"),
        (
            {
                "tool_choice": {"type": "tool", "name": "web_search"},
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "web_search",
        ),
        ({"tool_choice": {"type": "any"}}, "any"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "clear_tool"),
        ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "ttl"),
        ({"output_config": {"effort": "extreme"}}, "effort"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {"type": "text", "media_type": "text/plain", "data": "d"},
                            }
                        ],
                    }
                ]
            },
            "document",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "The answer is"},
                ]
            },
            "prefill",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ]
            },
            "url",
        ),
    ],
)
def test_unsupported_input_is_a_400_naming_it(body: dict[str, Any], names: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _plan(**{"messages": HELLO, **body})
    assert names in caught.value.message


def test_billing_header_is_removed() -> None:
    header = BILLING.format(123)
    assert adapt.system_text([wire.Block(type="text", text=header)]) is None
    both = [
        wire.Block(type="text", text=header),
        wire.Block(type="text", text="You are Claude Code."),
    ]
    assert adapt.system_text(both) == "You are Claude Code."
    assert adapt.system_text(f"{header}\nYou are Claude Code.") == "You are Claude Code."
    assert adapt.system_text("Mention x-anthropic-billing-header: here") is not None


def test_system_turns_fold_into_user_turns_when_needed() -> None:
    plan = _plan(
        system="top",
        messages=[
            {"role": "system", "content": "also top"},
            {"role": "user", "content": "q"},
            {"role": "system", "content": "mid"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"},
            {"role": "system", "content": [{"type": "text", "text": "end"}]},
        ],
    )
    folded = adapt.fold_system(plan.messages)
    assert folded is not None
    assert [m.role for m in folded] == ["system", "user", "assistant", "user"]
    assert folded[0].content == "top\nalso top"
    assert folded[1].content == "q\n<system-reminder>\nmid\n</system-reminder>"
    assert folded[3].content == "q2\n<system-reminder>\nend\n</system-reminder>"
    assert adapt.fold_system(folded) is None


# -- emitter -------------------------------------------------------------------------------

SCRIPTED: list[Event] = [
    Reasoning("The user wants "),
    Reasoning("weather."),
    Content("Checking."),
    ToolCallStart(0, "call_a", "get_weather"),
    ToolCallArgs(0, '{"city": '),
    ToolCallArgs(0, '"Paris"}'),
    ToolCallEnd(0),
    ToolCallStart(1, "call_b", "get_weather"),
    ToolCallArgs(1, '{"city": "Rome"}'),
    ToolCallEnd(1),
]


def _finished(reason: FinishReason, stop: str | None = None) -> Finished:
    return Finished(reason, GenerationStats(100, 12, cached_tokens=60), stop_string=stop)


@pytest.mark.parametrize("split", [1, 3, len(SCRIPTED)])
def test_emitter_stream_and_body_agree(split: int) -> None:
    streamed = MessageOutput(model=MODEL, prompt_tokens=100)
    whole = MessageOutput(model=MODEL, prompt_tokens=100)
    items = [streamed.start()]
    for i in range(0, len(SCRIPTED), split):
        items += streamed.feed(SCRIPTED[i : i + split])
        whole.feed(SCRIPTED[i : i + split])
    done = _finished(FinishReason.STOP)
    items += [*streamed.close(), streamed.delta(done), stop_event()]
    whole.close()
    events = Events(200, [(i["event"], json.loads(i["data"])) for i in items])
    rebuilt = check_stream(events)
    body = check_message(whole.body(done))
    assert [b.type for b in body.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert rebuilt.model_dump(exclude={"id", "content"}) == body.model_dump(
        exclude={"id", "content"}
    )
    for got, want in zip(rebuilt.content, body.content, strict=True):
        assert got.model_dump(exclude={"id"}) == want.model_dump(exclude={"id"})
    assert (
        body.content[0].type == "thinking" and body.content[0].thinking == "The user wants weather."
    )
    assert body.content[2].type == "tool_use" and body.content[2].input == {"city": "Paris"}
    assert body.stop_reason == "tool_use"
    usage = body.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (40, 60, 12)


@pytest.mark.parametrize(
    ("done", "reason", "sequence"),
    [
        (_finished(FinishReason.STOP), "end_turn", None),
        (_finished(FinishReason.STOP, "###"), "stop_sequence", "###"),
        (_finished(FinishReason.LENGTH), "max_tokens", None),
    ],
)
def test_stop_reasons(done: Finished, reason: str, sequence: str | None) -> None:
    out = MessageOutput(model=MODEL, prompt_tokens=100)
    out.feed([Content("hi")])
    out.close()
    body = check_message(out.body(done))
    assert (body.stop_reason, body.stop_sequence) == (reason, sequence)


def test_error_event_is_anthropic_shaped() -> None:
    (item,) = error_events(InternalError("boom"))
    assert item["event"] == "error"
    assert check_error(json.loads(item["data"]), "api_error") == "boom"


def test_omitted_thinking_travels_only_in_the_signature() -> None:
    out = MessageOutput(model=MODEL, prompt_tokens=10, omit_thinking=True)
    items = [out.start(), *out.feed([Reasoning("secret "), Reasoning("plan"), Content("hi")])]
    done = _finished(FinishReason.STOP)
    items += [*out.close(), out.delta(done), stop_event()]
    events = Events(200, [(i["event"], json.loads(i["data"])) for i in items])
    streamed = check_stream(events)
    deltas = [e["delta"]["type"] for e in events.named("content_block_delta")]
    assert deltas == ["signature_delta", "text_delta"]
    body = Message.model_validate(out.body(done))
    for msg in (streamed, body):
        thinking = msg.content[0]
        assert thinking.type == "thinking" and thinking.thinking == ""
        assert thinking_from_signature(thinking.signature) == "secret plan"
