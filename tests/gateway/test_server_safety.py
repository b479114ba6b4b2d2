"""A server safe to leave running: API key, CORS, body / prompt / max_tokens caps, a
bounded queue that answers 429, errors after a stream began, and keepalives.

Two live servers: SmolLM2 behind every limit, and one whose engine runs a scripted
stand-in for the model (so a full queue, a failing generation and a prefill that lasts
until the test says can be produced on demand).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from gateway.core.models.build import build_served  # noqa: E402
from gateway.core.models.served import ServedModel  # noqa: E402
from gateway.core.settings import ServerSettings  # noqa: E402
from runtime.engine import Engine, RequestHandle  # noqa: E402
from runtime.types import Finished, FinishReason, GenerationStats, TextDelta  # noqa: E402
from templates import Message, Renderer, RenderOptions, TemplateError, Tool  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.openai_checks import (  # noqa: E402
    chat_body,
    chat_chunks,
    error_of,
    open_after,
    post,
    stream,
)

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
KEY = "sk-test-key"
ORIGIN = "http://allowed.example"
HELLO = [{"role": "user", "content": "Name three colors."}]
CHAT = "/v1/chat/completions"
AUTH = {"authorization": f"Bearer {KEY}"}

SECURE = ServerSettings(
    api_key=KEY,
    cors_origins=(ORIGIN,),
    max_body_bytes=64 * 1024,
    max_prompt_tokens=300,
    max_tokens_cap=16,
    strict_max_tokens=True,  # the caps answer with OpenAI's 400s, not a clamp
)


@pytest.fixture(scope="module")
def secure_url(smollm2_gguf: Path) -> Iterator[str]:
    with live_server(lambda: build_served(smollm2_gguf, model_id=MODEL), SECURE) as url:
        yield url


def _ok(url: str) -> None:
    chat_body(post(url, CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 2}, AUTH))


# -- API key -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", CHAT),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/metrics"),
        ("GET", "/debug/prefix-cache"),
    ],
)
def test_every_route_but_health_needs_the_key(secure_url: str, method: str, path: str) -> None:
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"x-api-key": "wrong"},
        {"authorization": KEY},
    ):
        r = httpx.request(method, f"{secure_url}{path}", headers=headers, json={})
        err = error_of(r, 401)
        assert err["code"] == "invalid_api_key" and "Bearer" in r.headers["www-authenticate"]
    assert httpx.get(f"{secure_url}/health").status_code == 200


def test_both_key_headers_are_accepted(secure_url: str) -> None:
    assert httpx.get(f"{secure_url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{secure_url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    good = openai.OpenAI(base_url=f"{secure_url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list()] == [MODEL]
    bad = openai.OpenAI(base_url=f"{secure_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=HELLO)


# -- CORS ----------------------------------------------------------------------------------


def test_cors_allow_list(secure_url: str) -> None:
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type",
    }
    ok = httpx.options(f"{secure_url}{CHAT}", headers={"origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    evil = httpx.options(
        f"{secure_url}{CHAT}", headers={"origin": "http://evil.example", **preflight}
    )
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
    # answers carry the header for allowed origins, refusals included (so a page can read them)
    refused = httpx.get(f"{secure_url}/v1/models", headers={"origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{secure_url}/v1/models", headers={"origin": "http://evil.example", **AUTH})
    assert "access-control-allow-origin" not in other.headers


# -- limits --------------------------------------------------------------------------------


def test_body_size_cap(secure_url: str) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}
    err = error_of(post(secure_url, CHAT, big, AUTH), 413)
    assert "65536" in err["message"]
    # without a declared length too (chunked upload)
    chunks = iter(
        [
            b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "',
            b"y" * 70_000,
            b'"}]}',
        ]
    )
    r = httpx.post(
        f"{secure_url}{CHAT}", content=chunks, headers={"content-type": "application/json", **AUTH}
    )
    error_of(r, 413)
    _ok(secure_url)


def test_an_upload_over_the_cap_ends_in_an_orderly_close(secure_url: str) -> None:
    """The 413 goes out as soon as the head declares too many bytes, with the body
    unread. Closing a socket on unread bytes makes the kernel reset the connection, and
    a client still sending sees "connection reset" (some stacks drop the answer with
    it). The server lingers instead: it sends the answer and its end, reads and drops
    what still comes, and closes once the client has closed its side."""
    host, port = secure_url.removeprefix("http://").split(":")
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-length: {8 << 20}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + b"{" + b" " * (1 << 20))  # more than the server reads
        received = b""
        while b"\r\n\r\n" not in received or not received.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        sock.sendall(b" " * (1 << 20))  # the client goes on sending: still read
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(65536) == b""  # the server's end, not a reset
    status, _, rest = received.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large", status
    assert b"65536" in rest.partition(b"\r\n\r\n")[2]
    _ok(secure_url)


def test_prompt_and_max_tokens_caps(secure_url: str) -> None:
    long = [{"role": "user", "content": "word " * 400}]
    err = error_of(
        post(secure_url, CHAT, {"model": MODEL, "messages": long, "max_tokens": 2}, AUTH), 400
    )
    assert err["code"] == "context_length_exceeded" and "300" in err["message"]
    for field in ("max_tokens", "max_completion_tokens"):
        err = error_of(
            post(secure_url, CHAT, {"model": MODEL, "messages": HELLO, field: 17}, AUTH), 400
        )
        assert err["param"] == field and "16" in err["message"]
    err = error_of(
        post(
            secure_url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 17}, AUTH
        ),
        400,
    )
    assert err["param"] == "max_tokens"
    body = chat_body(
        post(secure_url, CHAT, {"model": MODEL, "messages": HELLO, "temperature": 0}, AUTH)
    )
    assert body.usage is not None and body.usage.completion_tokens <= 16  # the cap is the default


# -- a scripted engine ---------------------------------------------------------------------


class ScriptedRunner:
    """Stands in for the model: blocks on a gate, prefills until told, or fails mid-way."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.prefill = threading.Event()  # the prompt is read once this is set
        self.prefill.set()
        self.fail_after: int | None = None
        self.text: list[str] | None = None  # the pieces to write instead of "t0 t1 ..."

    def run(self, handle: RequestHandle) -> Finished:
        self.gate.wait(60)
        prompt = len(handle.request.prompt_tokens)
        while not self.prefill.wait(0.01):
            if handle.cancelled:  # the client left mid-prefill: stop, as a model would
                break
        n = 0
        for n in range(handle.request.max_tokens):
            if handle.cancelled:
                return Finished(FinishReason.CANCELLED, GenerationStats(prompt, n))
            if self.fail_after is not None and n == self.fail_after:
                raise RuntimeError("scripted failure")
            if self.text is not None and n == len(self.text):
                return Finished(FinishReason.STOP, GenerationStats(prompt, n))
            piece = f"t{n} " if self.text is None else self.text[n]
            handle.emit(TextDelta(piece, (n,)))
        return Finished(FinishReason.LENGTH, GenerationStats(prompt, n + 1))


class StrictTemplate:
    """The model's renderer, except that it refuses conversations as some templates do."""

    def __init__(self, inner: Renderer) -> None:
        self.inner = inner

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        if any(m.role == "user" and m.content == "refuse me" for m in messages):
            raise TemplateError(
                "Conversation roles must alternate user/assistant/user/assistant/..."
            )
        return self.inner.render(messages, tools, options)


def _scripted_served(path: Path, runner: ScriptedRunner) -> ServedModel:
    served = build_served(path, model_id=MODEL)
    engine = Engine(runner, max_queue=3)
    return dataclasses.replace(
        served, engine=engine, runner=None, renderer=StrictTemplate(served.renderer)
    )


@pytest.fixture(scope="module")
def scripted(smollm2_gguf: Path) -> Iterator[tuple[str, ScriptedRunner]]:
    runner = ScriptedRunner()

    def load() -> ServedModel:
        return _scripted_served(smollm2_gguf, runner)

    with live_server(load, ServerSettings(keepalive_seconds=0.2)) as url:
        yield url, runner


@pytest.fixture
def script(scripted: tuple[str, ScriptedRunner]) -> Iterator[tuple[str, ScriptedRunner]]:
    url, runner = scripted
    yield url, runner
    runner.gate.set()
    runner.prefill.set()
    runner.fail_after = None
    runner.text = None


async def _wait_health(url: str, client: httpx.AsyncClient, **want: Any) -> None:
    for _ in range(200):
        health = (await client.get(f"{url}/health")).json()
        if all(health[k] == v for k, v in want.items()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"health never reached {want}: {health}")


def test_full_queue_answers_429_with_retry_after(script: tuple[str, ScriptedRunner]) -> None:
    url, runner = script
    runner.gate.clear()
    req = {"model": MODEL, "messages": HELLO, "max_tokens": 3}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.ensure_future(client.post(f"{url}{CHAT}", json=req))
            await _wait_health(url, client, busy=True)
            # more choices than the queue can ever hold: the request itself is wrong
            assert (
                error_of(await client.post(f"{url}{CHAT}", json={**req, "n": 4}), 400)["param"]
                == "n"
            )
            waiting = [asyncio.ensure_future(client.post(f"{url}{CHAT}", json=req))]
            await _wait_health(url, client, queue_depth=1)
            # n=3 needs three places and two are free: refused whole, nothing left queued
            err = error_of(await client.post(f"{url}{CHAT}", json={**req, "n": 3}), 429)
            assert err["code"] == "queue_full"
            await _wait_health(url, client, queue_depth=1)
            waiting += [
                asyncio.ensure_future(client.post(f"{url}{CHAT}", json=req)) for _ in range(2)
            ]
            await _wait_health(url, client, queue_depth=3)
            full = await client.post(f"{url}{CHAT}", json=req)
            assert error_of(full, 429)["type"] == "rate_limit_error"
            assert int(full.headers["retry-after"]) >= 1
            runner.gate.set()
            for done in await asyncio.gather(first, *waiting):
                chat_body(done)
            await _wait_health(url, client, busy=False, queue_depth=0)

    asyncio.run(scenario())


def test_error_after_stream_began_is_an_sse_error_event(script: tuple[str, ScriptedRunner]) -> None:
    url, runner = script
    runner.fail_after = 2
    sse = stream(url, CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 8})
    assert sse.status == 200 and sse.done, "the stream is closed with [DONE]"
    contents = [
        d
        for d in sse.data
        if "choices" in d and d["choices"] and d["choices"][0]["delta"].get("content")
    ]
    assert len(contents) == 2
    assert (
        sse.data[-1]["error"]["code"] == "generation_failed"
        # the failure's text stays in the server's log, under the id the message names
        and sse.data[-1]["error"]["message"].startswith("internal error (request id req_")
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="internal error"):
        for _ in client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=8, stream=True
        ):
            pass
    err = error_of(post(url, CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 8}), 500)
    assert err["code"] == "generation_failed"
    runner.fail_after = None
    texts = chat_chunks(stream(url, CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 3}))
    assert texts[-1].choices[0].finish_reason == "length"


def test_keepalive_comments_during_a_long_prefill(script: tuple[str, ScriptedRunner]) -> None:
    """The prefill lasts until the client has read two keepalive comments (a stuck stream
    fails on the client's read timeout); then the stream ends as usual."""
    url, runner = script
    runner.prefill.clear()
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    sse = stream(url, CHAT, body, on_line=open_after(runner.prefill, 2))
    chat_chunks(sse)
    assert sse.comments_before_data >= 2, sse.comments


def test_template_refusal_is_a_422(script: tuple[str, ScriptedRunner]) -> None:
    url, _ = script
    body = {"model": MODEL, "messages": [{"role": "user", "content": "refuse me"}]}
    err = error_of(post(url, CHAT, body), 422)
    assert err["param"] == "messages" and "alternate" in err["message"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "refuse me"}]
        )
    err = error_of(httpx.post(f"{url}/tokenize", json={"messages": body["messages"]}), 422)


def test_a_stopped_engine_answers_503_with_retry_after(smollm2_gguf: Path) -> None:
    runner = ScriptedRunner()
    served = _scripted_served(smollm2_gguf, runner)
    with live_server(lambda: served) as url:
        chat_body(post(url, CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 2}))
        served.engine.stop()
        r = post(url, CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 2})
        assert error_of(r, 503)["type"] == "overloaded_error" and int(r.headers["retry-after"]) >= 1
        assert httpx.get(f"{url}/health").status_code == 503


_CITY: dict[str, Any] = {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # fmt: skip
_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": _CITY}}


@pytest.fixture(scope="module")
def scripted_qwen3(tiny_qwen3_dir: Path) -> Iterator[tuple[str, ScriptedRunner]]:
    """A scripted runner behind a model with a tool-call format (hermes)."""
    runner = ScriptedRunner()
    with live_server(lambda: _scripted_served(tiny_qwen3_dir, runner)) as url:
        yield url, runner


def test_tool_markup_cut_off_by_max_tokens_is_not_content(
    scripted_qwen3: tuple[str, ScriptedRunner],
) -> None:
    """A reply that reaches max_tokens just after opening a second call: every dialect
    returns the whole call and finish reason length, and no `<tool_call>` as text."""
    url, runner = scripted_qwen3
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    runner.text = [call, "<tool_call>", '\n{"name"', ': "get_weather"', ""]
    chat = {"model": MODEL, "messages": HELLO, "tools": [_WEATHER], "max_tokens": 3}
    body = chat_body(post(url, CHAT, chat))
    (choice,) = body.choices
    assert choice.finish_reason == "length" and not choice.message.content
    assert [c.model_dump()["function"]["name"] for c in choice.message.tool_calls or []] == [
        "get_weather"
    ]
    chunks = chat_chunks(stream(url, CHAT, chat))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    assert sum(len(d.tool_calls or []) for d in deltas if d.tool_calls and d.tool_calls[0].id) == 1
    anthropic_body = {"model": MODEL, "max_tokens": 3, "messages": HELLO, "tools": [
        {"name": "get_weather", "input_schema": _CITY}]}  # fmt: skip
    message = post(url, "/v1/messages", anthropic_body).json()
    assert message["stop_reason"] == "max_tokens"
    assert [b["type"] for b in message["content"]] == ["tool_use"]
    responses_body = {"model": MODEL, "input": "Weather?", "max_output_tokens": 3,
                      "tools": [{"type": "function", "name": "get_weather", "parameters": _CITY}]}  # fmt: skip
    response = post(url, "/v1/responses", responses_body).json()
    assert [item["type"] for item in response["output"]] == ["function_call"]
    runner.text = [call, "Done."]  # a natural end after text: nothing is dropped
    message = post(url, "/v1/messages", anthropic_body).json()
    assert [b["type"] for b in message["content"]] == ["tool_use", "text"]
