"""/v1/responses without a server: input items to messages, tools and tool_choice,
the response store's bounds and chains, the reasoning seal."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from openai.types.responses import Response

from gateway.core.errors import InternalError, NotFound
from gateway.core.reply import Reply
from gateway.openai.responses.adapt import response_plan
from gateway.openai.responses.emit import ResponseBuilder, custom_input, envelope
from gateway.openai.responses.items import input_items, to_messages
from gateway.openai.responses.store import ReasoningSeal, ResponseStore
from gateway.openai.responses.tools import ToolRef, tool_plan
from gateway.openai.responses.wire import ResponsesRequest
from parsers.events import Content, ToolCallArgs, ToolCallEnd, ToolCallStart
from runtime.types import Finished, FinishReason, GenerationStats
from tests.gateway.openai.test_responses import APPLY_PATCH, EVENTS, HOSTED, PATCH_GRAMMAR, PING


def _messages(items: list[dict[str, Any]], seal: ReasoningSeal | None = None) -> tuple[Any, ...]:
    req = ResponsesRequest.model_validate({"input": items})
    opener = (seal or ReasoningSeal()).open
    return to_messages([], input_items(req, lambda _: None), instructions="Sys", open_sealed=opener)


def test_assistant_items_join_one_turn() -> None:
    call = {"type": "function_call", "name": "ping", "arguments": "{}"}
    msgs = _messages([
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": "Go"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
        {**call, "call_id": "a"}, {**call, "call_id": "b", "namespace": "net"},
        {"type": "function_call_output", "call_id": "a", "output": "pong"},
        {"type": "custom_tool_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "*** Begin"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    ])  # fmt: skip
    assert [m.role for m in msgs] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    turn = msgs[3]
    assert (turn.content, turn.reasoning) == ("On it.", "sum")
    assert [(c.id, c.name) for c in turn.tool_calls] == [("a", "ping"), ("b", "net.ping")]
    assert (msgs[4].tool_call_id, msgs[4].content, msgs[5].content) == ("a", "pong", "ok")
    (patch,) = msgs[6].tool_calls
    assert json.loads(patch.arguments) == {"input": "*** Begin"}


def test_reasoning_text_comes_from_content_seal_or_summary() -> None:
    seal = ReasoningSeal()
    answer = {"role": "assistant", "content": "A"}

    def reasoning_of(item: dict[str, Any], with_seal: ReasoningSeal = seal) -> str | None:
        return _messages([{"type": "reasoning", "summary": [], **item}, answer], with_seal)[
            -1
        ].reasoning

    assert reasoning_of({"content": [{"type": "reasoning_text", "text": "plain"}]}) == "plain"
    assert reasoning_of({"encrypted_content": seal.seal("sealed")}) == "sealed"
    assert reasoning_of({"encrypted_content": seal.seal("sealed")}, ReasoningSeal()) is None
    assert (
        reasoning_of(
            {
                "encrypted_content": "gAAAAABnot-ours",
                "summary": [{"type": "summary_text", "text": "s"}],
            }
        )
        == "s"
    )


def test_tools_flatten_namespaces_and_describe_custom_grammars() -> None:
    req = ResponsesRequest.model_validate({"input": "x", "tools": [
        PING, APPLY_PATCH, *HOSTED, {"type": "brand_new_tool"},
        {"type": "namespace", "name": "multi", "description": "d", "tools": [{**PING, "name": "spawn"}, {**APPLY_PATCH, "name": "edit"}]},
    ], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "ping"}, {"type": "custom", "name": "edit"}]}})  # fmt: skip
    plan, names = tool_plan(req, supported=True)
    assert [t.name for t in plan.tools] == ["ping", "apply_patch", "multi.spawn", "multi.edit"]
    assert names["multi.edit"] == ToolRef("custom", "edit", "multi")
    patch = plan.tools[1]
    assert patch.description and PATCH_GRAMMAR in patch.description
    assert patch.parameters["required"] == ["input"]
    # allowed_tools: everything stays in the prompt, only the allowed are read as calls
    assert [s["function"]["name"] for s in plan.schemas] == ["ping", "multi.edit"]
    assert plan.choice == "auto"
    forced = req.model_copy(update={"tool_choice": {"type": "custom", "name": "edit"}})
    assert tool_plan(forced, supported=True)[0].name == "multi.edit"


def test_custom_input_reads_the_string_argument() -> None:
    assert custom_input('{"input": "*** Begin Patch\\n"}') == "*** Begin Patch\n"
    assert custom_input('{"patch": "x"}') == "x"
    assert custom_input('{"a": 1, "b": 2}') == '{"a": 1, "b": 2}'


def _stored(store: ResponseStore, rid: str, previous: str | None, text: str = "x") -> None:
    item = {"type": "message", "id": f"msg_{rid}", "role": "user", "content": text}
    store.put({"id": rid, "object": "response"}, [item], previous)


def test_store_rebuilds_chains_and_stays_bounded() -> None:
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    _stored(store, "r1", None)
    _stored(store, "r2", "r1")
    _stored(store, "r3", "r2")
    assert [i["id"] for i in store.history("r3")] == ["msg_r1", "msg_r2", "msg_r3"]
    assert store.item("msg_r2") is not None
    # reading a chain refreshes its ancestors last: a leaf goes before what it needs
    _stored(store, "other", None)
    assert len(store) == 3 and store.get("r3") is None and store.item("msg_r3") is None
    assert [i["id"] for i in store.history("r2")] == ["msg_r1", "msg_r2"]
    assert store.delete("r1") and not store.delete("r1")
    with pytest.raises(NotFound, match="r1"):
        store.history("r2")
    big = ResponseStore(max_responses=100, max_bytes=600)
    for n in range(5):
        _stored(big, f"b{n}", None, "y" * 150)
    assert 0 < len(big) < 5 and big.bytes <= 600 and big.get("b4") is not None
    _stored(big, "huge", None, "z" * 1000)  # larger than the whole store: not kept
    assert big.get("huge") is None


def test_seal_accepts_only_its_own_text() -> None:
    seal = ReasoningSeal()
    sealed = seal.seal("thinking…")
    assert seal.open(sealed) == "thinking…"
    assert ReasoningSeal().open(sealed) is None
    assert seal.open("not base64!") is None
    payload = json.loads(base64.b64decode(sealed))
    forged = base64.b64encode(json.dumps({**payload, "text": "other"}).encode()).decode()
    assert seal.open(forged) is None


def _builder(tools: list[dict[str, Any]], **kw: Any) -> ResponseBuilder:
    req = ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": tools})
    adapted = response_plan(req, history=[], lookup=lambda _: None, open_sealed=lambda _: None,
                            tools_supported=True)  # fmt: skip
    return ResponseBuilder(envelope(req, "m", adapted.plan), adapted.names, **kw)


def _finished(reason: FinishReason = FinishReason.STOP) -> Reply:
    reply = Reply()
    reply.done = Finished(
        reason, GenerationStats(prompt_tokens=5, completion_tokens=7, cached_tokens=2)
    )
    return reply


def _valid(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_custom_calls_are_decoded_from_their_arguments() -> None:
    b = _builder([PING, APPLY_PATCH])
    events = b.start() + b.feed([
        Content("Patching."),
        ToolCallStart(0, "call_a", "apply_patch"),
        ToolCallArgs(0, '{"input": "*** Begin'), ToolCallArgs(0, ' Patch\\n"}'), ToolCallEnd(0),
        ToolCallStart(1, "call_b", "ping"), ToolCallArgs(1, "{}"), ToolCallEnd(1),
    ]) + b.finish(_finished())  # fmt: skip
    _valid(events)
    final = Response.model_validate(events[-1]["response"])
    assert [i.type for i in final.output] == ["message", "custom_tool_call", "function_call"]
    call = final.output[1]
    assert call.type == "custom_tool_call" and call.input == "*** Begin Patch\n"
    assert call.call_id == "call_a" and call.id and call.id.startswith("ctc_")
    kinds = [e["type"] for e in events]
    assert kinds.count("response.custom_tool_call_input.done") == 1
    assert kinds.count("response.function_call_arguments.delta") == 1  # the ping's only
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 2


def test_errors_after_the_stream_began_fail_the_response() -> None:
    b = _builder([])
    events = _valid(
        b.start() + b.feed([Content("Hel")]) + b.failed(InternalError("Generation failed: boom"))
    )
    assert events[-1]["type"] == "response.failed"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "server_error" and "boom" in failed.error.message
    # nothing sent yet (not even response.created): a bare error event
    (error,) = _valid(_builder([]).failed(InternalError("early")))
    assert error["type"] == "error" and error["message"] == "early"
