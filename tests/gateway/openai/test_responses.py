"""POST /v1/responses, GET and DELETE /v1/responses/{id}, against live servers.

Every body is validated with the OpenAI SDK's `Response` and every streamed event with
its `ResponseStreamEvent` union; the stream's order (items opened and closed, deltas
adding up to the done texts, sequence numbers) is checked on top. The shapes run on a
tiny random Qwen3 with the real tokenizer and template (fast, output is noise); calls
that need sense, and the openai-agents tool loop, run on Qwen2.5-Coder-0.5B.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

from gateway.core.models.build import build_served  # noqa: E402
from gateway.core.settings import ServerSettings  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402

TINY = "tiny-qwen3"
QWEN = "qwen2.5-coder-0.5b"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
# a tool without required arguments: a forced call to it completes even with the
# random model's output (the call starts in the prompt's opener)
PING = {"type": "function", "name": "ping", "description": "Check the service.",
        "parameters": {"type": "object", "properties": {"host": {"type": "string"}}}}  # fmt: skip
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
        "required": ["city"],
    },
}
PATCH_GRAMMAR = (
    'start: "*** Begin Patch" LF hunk+ "*** End Patch"\nhunk: /.+/ LF\n%import common.LF\n'
)
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch. This is a FREEFORM tool: do not wrap it in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
HOSTED: list[dict[str, Any]] = [
    {"type": "web_search", "external_web_access": False},
    {"type": "web_search_preview"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "computer_use_preview", "display_width": 800, "display_height": 600,
     "environment": "linux"},
    {"type": "local_shell"},
    {"type": "mcp", "server_label": "docs", "server_url": "https://example.com/mcp"},
]  # fmt: skip


# -- servers ----------------------------------------------------------------------------


def _thinking_variant(source: Path, out: Path) -> Path:
    """The tiny model with a template that opens <think> in the generation prompt (as
    Qwen3's Thinking-2507 templates do), so its random output lands in reasoning."""
    for f in source.iterdir():
        if f.suffix == ".safetensors":
            (out / f.name).symlink_to(f)  # the weights are shared, not copied
        else:
            shutil.copy(f, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    tail = "    {%- endif %}\n{%- endif %}"
    assert cfg["chat_template"].rstrip().endswith(tail)
    opened = "    {%- else %}\n        {{- '<think>\\n' }}\n" + tail
    cfg["chat_template"] = cfg["chat_template"].rstrip()[: -len(tail)] + opened
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def base_url(tiny_qwen3_dir: Path) -> Iterator[str]:
    aliases = frozenset({"fake-model", "gpt-5.5"})  # the names the captured clients asked for
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=TINY, aliases=aliases)) as url:
        yield url


@pytest.fixture(scope="module")
def thinking_url(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = _thinking_variant(tiny_qwen3_dir, tmp_path_factory.mktemp("tiny-qwen3-thinking"))
    with live_server(lambda: build_served(folder, model_id=TINY)) as url:
        yield url


@pytest.fixture(scope="module")
def qwen_url(qwen25_gguf: Path) -> Iterator[str]:
    with live_server(lambda: build_served(qwen25_gguf, model_id=QWEN)) as url:
        yield url


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


# -- checks -----------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/responses", json=body, timeout=300)


def _body(r: httpx.Response) -> Response:
    assert r.status_code == 200, r.text
    body = Response.model_validate(r.json())
    assert body.object == "response" and body.id.startswith("resp_")
    return body


def _error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return str(err["message"])


def _events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Stream a request; every event validated, named by its `event:` line, numbered
    in order, and the last one terminal."""
    payloads: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                payload = json.loads(line[5:])
                assert payload["type"] == name
                EVENTS.validate_python(payload)
                payloads.append(payload)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert payloads[-1]["type"] in TERMINAL
    assert all(p["type"] not in TERMINAL for p in payloads[:-1])
    return payloads


def _streamed_text(events: list[dict[str, Any]], kind: str, item_id: str) -> str:
    return "".join(e["delta"] for e in events if e["type"] == kind and e["item_id"] == item_id)


def _check_order(events: list[dict[str, Any]]) -> Response:
    """Items open and close in order, deltas only inside their item, and the deltas add
    up to what the done events and the final response say. Returns the final response."""
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = Response.model_validate(events[-1]["response"])
    open_ids: dict[str, int] = {}
    done: list[dict[str, Any]] = []
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(done) + len(open_ids) and not open_ids
            open_ids[e["item"]["id"]] = e["output_index"]
        elif e["type"] == "response.output_item.done":
            assert open_ids.pop(e["item"]["id"]) == e["output_index"]
            done.append(e["item"])
        elif "item_id" in e:
            assert open_ids.get(e["item_id"]) == e["output_index"], e
    assert not open_ids, "every item added is done"
    assert events[-1]["response"]["output"] == done
    for item in done:
        if item["type"] == "message":
            assert (
                _streamed_text(events, "response.output_text.delta", item["id"])
                == item["content"][0]["text"]
            )
        elif item["type"] == "function_call":
            assert (
                _streamed_text(events, "response.function_call_arguments.delta", item["id"])
                == item["arguments"]
            )
        elif item["type"] == "reasoning":
            assert (
                _streamed_text(events, "response.reasoning_text.delta", item["id"])
                == item["content"][0]["text"]
            )
    return final


def _text(body: Response) -> str:
    return "".join(
        part.text for item in body.output if item.type == "message" for part in item.content
        if part.type == "output_text"
    )  # fmt: skip


# -- text -------------------------------------------------------------------------------


def test_text_body_through_the_sdk(base_url: str) -> None:
    client = _client(base_url)
    raw = client.responses.with_raw_response.create(
        model=TINY, input="Say hi.", instructions="Be brief.", max_output_tokens=12,
        temperature=0, metadata={"run": "1"}, user="u1", prompt_cache_key="k1",
    )  # fmt: skip
    body = Response.model_validate(raw.http_response.json())
    assert raw.parse().id == body.id
    assert body.status == "incomplete" and body.incomplete_details is not None
    assert body.incomplete_details.reason == "max_output_tokens"
    (item,) = body.output
    assert item.type == "message" and item.id.startswith("msg_") and item.status == "incomplete"
    assert _text(body) and body.output_text == _text(body)
    usage = body.usage
    assert usage is not None and usage.output_tokens == 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert (body.instructions, body.metadata, body.user) == ("Be brief.", {"run": "1"}, "u1")
    assert body.temperature == 0 and body.prompt_cache_key == "k1"
    # the instructions are in the prompt: the same input without them is shorter
    plain = _body(_post(base_url, {"model": TINY, "input": "Say hi.", "max_output_tokens": 1}))
    assert plain.usage is not None and plain.usage.input_tokens < usage.input_tokens


def test_text_stream_through_the_sdk(base_url: str) -> None:
    request = {"model": TINY, "input": [{"role": "user", "content": "Count to five."}],
               "max_output_tokens": 10, "temperature": 0}  # fmt: skip
    # the SDK's stream helper accumulates the events (and checks they fit together);
    # its get_final_response() wants response.completed, which a cut reply does not send
    with _client(base_url).responses.stream(**request) as stream:
        seen = list(stream)
    kinds = [event.type for event in seen]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and "response.content_part.done" in kinds
    streamed = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    raw = _check_order(_events(base_url, request))
    assert streamed == _text(raw)  # greedy: the same text either way


def test_incomplete_at_max_output_tokens_and_store_false(base_url: str) -> None:
    events = _events(
        base_url, {"model": TINY, "input": "Hi", "max_output_tokens": 3, "store": False}
    )
    final = _check_order(events)
    assert events[-1]["type"] == "response.incomplete" and final.status == "incomplete"
    assert final.usage is not None and final.usage.output_tokens == 3
    assert httpx.get(f"{base_url}/v1/responses/{final.id}").status_code == 404


# -- reasoning --------------------------------------------------------------------------


def test_reasoning_stream_with_summary_and_sealed_text(thinking_url: str) -> None:
    request = {"model": TINY, "input": "Why is the sky blue?", "max_output_tokens": 12,
               "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"]}  # fmt: skip
    events = _events(thinking_url, request)
    final = _check_order(events)
    item = final.output[0]
    assert item.type == "reasoning" and item.id.startswith("rs_")
    text = item.content[0].text if item.content else ""
    assert text and [s.text for s in item.summary] == [text]
    assert _streamed_text(events, "response.reasoning_summary_text.delta", item.id) == text
    kinds = [e["type"] for e in events]
    for kind in ("response.reasoning_summary_part.added", "response.reasoning_summary_part.done",
                 "response.reasoning_text.done", "response.reasoning_summary_text.done"):  # fmt: skip
        assert kinds.count(kind) == 1
    assert item.encrypted_content and text not in item.encrypted_content
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0
    # without a summary asked for, none is streamed
    plain = _events(thinking_url, {**request, "reasoning": {}, "include": []})
    assert not any("summary" in e["type"] for e in plain)
    assert _check_order(plain).output[0].encrypted_content is None  # type: ignore[union-attr]


def test_effort_none_switches_thinking_off(thinking_url: str) -> None:
    body = _body(_post(thinking_url, {"model": TINY, "input": "Hi", "max_output_tokens": 6,
                                      "reasoning": {"effort": "none"}, "temperature": 0}))  # fmt: skip
    assert [item.type for item in body.output] == ["message"]
    assert body.reasoning is not None and body.reasoning.effort == "none"


def test_sealed_reasoning_round_trips(thinking_url: str) -> None:
    first = _body(_post(thinking_url, {"model": TINY, "input": "Plan a trip.", "store": False,
                                       "max_output_tokens": 8, "include": ["reasoning.encrypted_content"]}))  # fmt: skip
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.content and reasoning.encrypted_content
    text = reasoning.content[0].text

    def turn(item: dict[str, Any]) -> int:
        # reasoning shows in the prompt for an assistant turn after the last user query
        call = {"type": "function_call", "call_id": "call_1", "name": "ping", "arguments": "{}"}
        out = {"type": "function_call_output", "call_id": "call_1", "output": "pong"}
        body = {"model": TINY, "input": [{"role": "user", "content": "Plan a trip."}, item, call, out],
                "tools": [PING], "max_output_tokens": 1}  # fmt: skip
        usage = _body(_post(thinking_url, body)).usage
        assert usage is not None
        return usage.input_tokens

    sealed = turn({"type": "reasoning", "id": reasoning.id, "summary": [],
                   "encrypted_content": reasoning.encrypted_content})  # fmt: skip
    plain = turn(
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    )
    forged = turn({"type": "reasoning", "summary": [],
                   "encrypted_content": reasoning.encrypted_content[:-8] + "AAAAAAA="})  # fmt: skip
    empty = turn({"type": "reasoning", "summary": []})
    assert sealed == plain > forged == empty  # a foreign seal is ignored, not refused


# -- tools ------------------------------------------------------------------------------


def test_forced_function_call_streamed_and_not(base_url: str) -> None:
    # no arguments to choose and one call: the random model's near-tied logits cannot
    # make the call longer than the 6 tokens allowed
    ping = {
        **PING,
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    }
    request = {"model": TINY, "input": "Is the service up?", "tools": [ping, WEATHER],
               "tool_choice": {"type": "function", "name": "ping"}, "max_output_tokens": 6,
               "parallel_tool_calls": False}  # fmt: skip
    body = _body(_post(base_url, request))
    (call,) = body.output
    assert call.type == "function_call" and call.name == "ping" and call.status == "completed"
    assert call.id and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {}
    events = _events(base_url, request)
    final = _check_order(events)
    assert [i.type for i in final.output] == ["function_call"]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.function_call_arguments.done") < kinds.index(
        "response.output_item.done"
    )


def test_namespace_tools_are_flattened_and_mapped_back(base_url: str) -> None:
    agents_ns = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                 "tools": [{**PING, "name": "spawn_agent"}]}  # fmt: skip
    request = {"model": TINY, "input": "Start a helper.", "tools": [agents_ns, WEATHER],
               "tool_choice": {"type": "function", "name": "spawn_agent"}, "max_output_tokens": 4}  # fmt: skip
    body = _body(_post(base_url, request))
    (call,) = body.output
    assert call.type == "function_call"
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")
    assert body.tools[0].type == "namespace"  # the tools are echoed as sent
    # the call goes back in as history under its namespace, with its output
    follow = {"model": TINY, "tools": [agents_ns], "max_output_tokens": 2, "input": [
        {"role": "user", "content": "Start a helper."}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "started"}]}  # fmt: skip
    assert _body(_post(base_url, follow)).status == "incomplete"


def test_hosted_tools_are_left_out(base_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="gateway.openai.responses")
    alone = _body(
        _post(base_url, {"model": TINY, "input": "Hi", "tools": HOSTED, "max_output_tokens": 2})
    )
    with_ping = _body(_post(base_url, {"model": TINY, "input": "Hi", "tools": [*HOSTED, PING],
                                       "tool_choice": "auto", "max_output_tokens": 2}))  # fmt: skip
    nothing = _body(_post(base_url, {"model": TINY, "input": "Hi", "max_output_tokens": 2}))
    assert alone.usage and with_ping.usage and nothing.usage
    assert alone.usage.input_tokens == nothing.usage.input_tokens < with_ping.usage.input_tokens
    assert [t.type for t in alone.tools] == [t["type"] for t in HOSTED]
    for tool in HOSTED:
        assert f"{tool['type']!r} is a built-in OpenAI tool, not offered here" in caplog.text


# -- state ------------------------------------------------------------------------------


def test_previous_response_id_get_and_delete(base_url: str) -> None:
    client = _client(base_url)
    first = client.responses.create(model=TINY, input="Tell me about caches.", max_output_tokens=6)
    second = _body(_post(base_url, {"model": TINY, "input": "And more?", "max_output_tokens": 4,
                                    "previous_response_id": first.id}))  # fmt: skip
    assert second.previous_response_id == first.id
    assert first.usage and second.usage
    # the whole first turn is in the prompt, and the cache served its prefix
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    got = httpx.get(f"{base_url}/v1/responses/{first.id}")
    assert Response.model_validate(got.json()) == first
    assert client.responses.retrieve(first.id).id == first.id
    deleted = httpx.delete(f"{base_url}/v1/responses/{first.id}")
    assert deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    _error(httpx.get(f"{base_url}/v1/responses/{first.id}"), 404)
    _error(httpx.delete(f"{base_url}/v1/responses/{first.id}"), 404)
    gone = {"model": TINY, "input": "Again?", "previous_response_id": first.id}
    assert first.id in _error(_post(base_url, gone), 404, "previous_response_id")
    # its successor is stored, but its conversation cannot be rebuilt any more
    broken = _error(_post(base_url, {**gone, "previous_response_id": second.id}), 404)
    assert first.id in broken


def test_item_reference_resolves_stored_items(base_url: str) -> None:
    first = _body(_post(base_url, {"model": TINY, "input": "Hi", "max_output_tokens": 3}))
    ref = {"type": "item_reference", "id": first.output[0].id}
    again = _body(_post(base_url, {"model": TINY, "max_output_tokens": 1,
                                   "input": [{"role": "user", "content": "Hi"}, ref, {"role": "user", "content": "Ok"}]}))  # fmt: skip
    assert again.usage and first.usage
    assert again.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    missing = {"model": TINY, "input": [{"type": "item_reference", "id": "msg_unknown"}]}
    assert "msg_unknown" in _error(_post(base_url, missing), 400, "input[0].id")


# -- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"propertyNames": {}}}}},
         "text.format.schema"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
         "input[0].content[0].file_id"),
        ({"input": [{"type": "teleport", "id": "x"}]}, "input[0].type"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [PING]}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [PING]}, "tool_choice"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400(base_url: str, extra: dict[str, Any], param: str) -> None:
    _error(_post(base_url, {"model": TINY, "input": "Hi", **extra}), 400, param)


def test_truncation_auto_drops_the_oldest_turns(tiny_qwen3_dir: Path) -> None:
    turns: list[dict[str, Any]] = []
    for i in range(6):
        turns += [{"role": "user", "content": f"Question {i}: " + "tell me more " * 20},
                  {"role": "assistant", "content": f"Answer {i}: " + "here it is " * 20}]  # fmt: skip
    body = {"model": TINY, "instructions": "Be brief.", "max_output_tokens": 4,
            "input": [*turns, {"role": "user", "content": "Last question?"}]}  # fmt: skip
    settings = ServerSettings(max_prompt_tokens=300)
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=TINY), settings) as url:
        _error(_post(url, body), 400)
        fitted = _body(_post(url, {**body, "truncation": "auto"}))
        assert fitted.truncation == "auto" and fitted.usage is not None
        assert 0 < fitted.usage.input_tokens <= 300


# -- the captured clients ---------------------------------------------------------------


def _fixtures() -> Path | None:
    root = Path(__file__).resolve().parents[3]
    env = os.environ.get("MLX_GATEWAY_CLIENT_FIXTURES")
    for folder in (
        [Path(env)]
        if env
        else [root / "shared/fixtures/clients", root.parent / "shared/fixtures/clients"]
    ):
        if (folder / "codex_first_request.json").is_file():
            return folder
    return None


CAPTURED = ["codex_first_request", "codex_first_request_gpt55", "codex_tool_result_request",
            "openclaw_first_request_responses"]  # fmt: skip


@pytest.mark.parametrize("name", CAPTURED)
def test_captured_requests_replay(base_url: str, name: str) -> None:
    folder = _fixtures()
    if folder is None:
        pytest.skip("no captured client requests (set MLX_GATEWAY_CLIENT_FIXTURES)")
    request = json.loads((folder / f"{name}.json").read_text())
    # as sent, but cut short: the random model would otherwise write to the context's end
    events = _events(base_url, {**request, "max_output_tokens": 8})
    final = _check_order(events)
    assert final.status == "incomplete" and final.usage is not None
    assert final.usage.input_tokens > 4000  # the whole agent prompt, tools included
    assert events[-1]["type"] == "response.incomplete"
    if request.get("store") is False:
        assert httpx.get(f"{base_url}/v1/responses/{final.id}").status_code == 404


# -- Qwen2.5-Coder-0.5B: calls that need a real model -------------------------------------


@pytest.mark.real_model
def test_real_text_stream_completes(qwen_url: str) -> None:
    with _client(qwen_url).responses.stream(model=QWEN, input="Say hello in three words.",
                                            temperature=0, max_output_tokens=40) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert final.output_text.strip()


@pytest.mark.real_model
def test_real_function_call_streams_arguments(qwen_url: str) -> None:
    request = {"model": QWEN, "input": "What is the weather in Paris?", "tools": [WEATHER],
               "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0}  # fmt: skip
    events = _events(qwen_url, request)
    final = _check_order(events)
    assert events[-1]["type"] == "response.completed"
    (call,) = [i for i in final.output if i.type == "function_call"]
    assert call.name == "get_weather" and "paris" in json.loads(call.arguments)["city"].lower()
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) >= 3, "arguments stream as they are written"


@pytest.mark.real_model
def test_real_custom_tool_round_trip(qwen_url: str) -> None:
    ask = {"role": "user", "content": "Create hello.txt containing the word hi."}
    body = _body(_post(qwen_url, {"model": QWEN, "input": [ask], "tools": [APPLY_PATCH], "temperature": 0,
                                  "tool_choice": {"type": "custom", "name": "apply_patch"}, "max_output_tokens": 80}))  # fmt: skip
    (call,) = [i for i in body.output if i.type == "custom_tool_call"]
    assert call.name == "apply_patch" and call.call_id.startswith("call_")
    assert call.input.strip() and not call.input.lstrip().startswith("{")  # the string, not JSON
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}
    again = _body(_post(qwen_url, {"model": QWEN, "input": [ask, call.model_dump(exclude_none=True), result],
                                   "tools": [APPLY_PATCH], "temperature": 0, "max_output_tokens": 24}))  # fmt: skip
    assert again.output and again.usage is not None
    assert body.usage is not None and again.usage.input_tokens > body.usage.input_tokens


@pytest.mark.real_model
def test_openai_agents_tool_loop_over_responses(qwen_url: str) -> None:
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool  # type: ignore[untyped-decorator]  # imported via importorskip: Any
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        return f"It is 18 degrees Celsius and sunny in {city}."

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{qwen_url}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="You answer weather questions. Use the get_weather tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=QWEN, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0.0, max_tokens=80),
        # Qwen2.5-Coder-0.5B, greedy, calls the tool again whenever a tool result is the
        # last item (here and on chat completions alike): the framework's own loop runs
        # the tool the model asked for and returns its output
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls and "paris" in calls[0].lower()
    assert result.final_output == f"It is 18 degrees Celsius and sunny in {calls[0]}."
    (response,) = result.raw_responses
    assert [item.type for item in response.output] == ["function_call"]
