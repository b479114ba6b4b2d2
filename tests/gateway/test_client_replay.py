"""The real clients' captured requests (shared/fixtures/clients) replayed whole against a
live server, on the route each client used: every one gets a 200 and a well-formed
stream, and a client's second request reuses the prefix its first one left in the cache.

The model is the tiny random Qwen3 with the real Qwen3 tokenizer and template (tools and
thinking): it prefills the 10k-30k-token agent prompts in about a second, so the whole
prompts are replayed, tools and all. Its output is noise; only the wire is judged here
(the dialects' own suites check bodies and events against the SDK types in detail).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionChunk

from gateway.core.models.build import build_served
from gateway.core.prepare import prepare
from gateway.openai import adapt as chat_adapt
from gateway.openai import wire as chat_wire
from gateway.openai.responses.adapt import response_plan
from gateway.openai.responses.wire import ResponsesRequest
from tests.support.live_server import live_server

MODEL = "tiny-qwen3"
ENV = "MLX_GATEWAY_CLIENT_FIXTURES"
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"


def _folder() -> Path | None:
    """shared/fixtures/clients in the checkout or next to it, or the folder named by $ENV."""
    root = Path(__file__).resolve().parents[2]
    candidates = [Path(os.environ[ENV])] if os.environ.get(ENV) else []
    candidates += [root / "shared/fixtures/clients", root.parent / "shared/fixtures/clients"]
    return next((f for f in candidates if (f / "codex_first_request.json").is_file()), None)


def _names() -> list[str]:
    folder = _folder()
    return sorted(p.stem for p in folder.glob("*.json")) if folder else ["(none captured)"]


def _load(name: str) -> dict[str, Any]:
    folder = _folder()
    if folder is None:
        pytest.skip(f"no captured client requests (set {ENV} to shared/fixtures/clients)")
    data: dict[str, Any] = json.loads((folder / f"{name}.json").read_text())
    return data


def _route(name: str, body: dict[str, Any]) -> str:
    """The API a capture was sent to: Responses bodies carry `input`; Claude Code and
    OpenClaw's Anthropic provider speak Messages; the rest Chat Completions."""
    if "input" in body:
        return RESPONSES
    if name.startswith("claude_code") or name.endswith("_anthropic"):
        return MESSAGES
    return CHAT


def _limited(route: str, body: dict[str, Any], n: int) -> dict[str, Any]:
    field = {RESPONSES: "max_output_tokens", MESSAGES: "max_tokens"}.get(route)
    out = {**body, "model": MODEL, "stream": True}
    if field is None:
        out.pop("max_tokens", None)
        out["max_completion_tokens"] = n
        out["stream_options"] = {"include_usage": True}
    else:
        out[field] = n
    return out


@pytest.fixture(scope="module")
def base_url(tiny_qwen3_dir: Path) -> Iterator[str]:
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=MODEL)) as url:
        yield url


def _events(base_url: str, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's data payloads, after checking the status and the SSE framing."""
    headers = {"anthropic-version": "2023-06-01"} if route == MESSAGES else {}
    with httpx.stream(
        "POST", base_url + route, json=body, headers=headers, timeout=300
    ) as r:  # fmt: skip
        assert r.status_code == 200, r.read().decode()[:500]
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [ln[6:].strip() for ln in lines if ln.startswith("event:")]
    datas = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
    if route == CHAT:
        assert datas[-1] == "[DONE]"
        return [json.loads(d) for d in datas[:-1]]
    events = [json.loads(d) for d in datas]
    # named events, each naming its own payload's type (Claude Code and Codex need both)
    assert names == [e["type"] for e in events]
    return events


def _usage(route: str, events: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a finished stream."""
    if route == CHAT:
        chunks = [ChatCompletionChunk.model_validate(e) for e in events]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0
    if route == RESPONSES:
        last = events[-1]
        assert last["type"] in ("response.completed", "response.incomplete"), last["type"]
        u = last["response"]["usage"]
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    u = next(e for e in reversed(events) if e["type"] == "message_delta")["usage"]
    cached = u.get("cache_read_input_tokens") or 0
    return u["input_tokens"] + cached + (u.get("cache_creation_input_tokens") or 0), cached


@pytest.mark.parametrize("name", _names())
def test_every_capture_is_served_whole(base_url: str, name: str) -> None:
    body = _load(name)
    route = _route(name, body)
    prompt, _ = _usage(route, _events(base_url, route, _limited(route, body, 4)))
    assert prompt > 1000  # the whole agent prompt went in, tools and all


def _tokens(served: Any, route: str, body: dict[str, Any]) -> list[int]:
    """The prompt tokens the server renders for a body, computed here in-process."""
    if route == CHAT:
        req = chat_wire.ChatCompletionRequest.model_validate(body)
        plan = chat_adapt.chat_plan(req, vocab_size=served.vocab_size, tools_supported=True)
    else:
        plan = response_plan(
            ResponsesRequest.model_validate(body),
            history=[],
            lookup=lambda _: None,
            open_sealed=lambda _: None,
            tools_supported=True,
        ).plan
    return prepare(served, plan).tokens


PAIRS = [
    ("codex_first_request", "codex_tool_result_request"),
    ("openclaw_first_request_chat", "openclaw_tool_result_request_chat"),
]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_second_request_reuses_the_shared_prefix(
    tiny_qwen3_dir: Path, base_url: str, first: str, second: str
) -> None:
    """(Claude Code's pair, with its per-request attribution line, is checked in
    test_anthropic.py.) Cached tokens are within 64 of the prompts' common prefix."""
    a_body, b_body = _load(first), _load(second)
    route = _route(first, a_body)
    # a first line no other test sent: nothing of this conversation is cached before
    tag = f"Replay {os.getpid()}-{first}."
    if route == CHAT:
        for body in (a_body, b_body):
            body["messages"] = [{"role": "system", "content": tag}, *body["messages"]]
    else:
        for body in (a_body, b_body):
            body["instructions"] = tag + "\n" + str(body.get("instructions") or "")
    served = build_served(tiny_qwen3_dir, model_id=MODEL)
    a, b = (_tokens(served, route, {**x, "model": MODEL}) for x in (a_body, b_body))
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    assert common > 0.9 * len(a)  # the second request extends the first conversation
    _events(base_url, route, _limited(route, a_body, 1))
    prompt, cached = _usage(route, _events(base_url, route, _limited(route, b_body, 1)))
    assert prompt == len(b)
    assert common - 64 <= cached <= common, (common, cached)
