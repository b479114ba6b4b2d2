"""The soak's kinds of request. Each sends one request (a burst sends several) and
checks the answer (tests/support/soak/checks.py); `run` turns what happened into `Outcome`s:

- ok: a valid answer (for a malformed body: its dialect's 4xx error; for a client that
  left: every event it read was valid);
- 429 / 503: the queue was full, or the engine was restarting or draining: allowed, if
  the error is well formed and says when to retry;
- invalid: a body, event or error that breaks its dialect's contract, or a 4xx for a
  request that was valid;
- 5xx: any other server error;
- lost: the connection failed or timed out (the server never answered).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.soak import checks
from tests.support.soak.checks import Invalid, Stream, ensure
from tests.support.soak.prompts import (
    SCHEMA,
    TOOLS_ANTHROPIC,
    TOOLS_OPENAI,
    Prompts,
    split_system,
)

OK, REJECTED, UNAVAILABLE, INVALID, SERVER_ERROR, LOST = (
    "ok", "429", "503", "invalid", "5xx", "lost"
)  # fmt: skip
VERDICTS = (OK, REJECTED, UNAVAILABLE, INVALID, SERVER_ERROR, LOST)
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"


@dataclass
class Outcome:
    kind: str
    verdict: str
    status: int | None
    seconds: float = 0.0
    cached: int = 0  # prompt tokens the server says it reused
    detail: str = ""


@dataclass
class Ctx:
    """One client's connection, randomness and settings."""

    client: httpx.Client
    rng: random.Random
    prompts: Prompts
    model: str  # the default model, with its own chat template
    tools_model: str  # the same weights, rendered with a tool-calling template
    burst: int = 12  # requests a burst sends at once: more than the queue holds
    min_tokens: int = 16
    max_tokens: int = 48
    last_response: str | None = field(default=None)  # for previous_response_id

    def tokens(self) -> int:
        return self.rng.randint(self.min_tokens, self.max_tokens)

    def temperature(self) -> float:
        return self.rng.choice((0.0, 0.0, 0.7, 1.0))


# -- one exchange ----------------------------------------------------------------------------


def _refused(kind: str, r: httpx.Response, dialect: str) -> Outcome:
    message = checks.error_body(r, dialect)[:160]
    if r.status_code == 429:
        return Outcome(kind, REJECTED, 429, detail=message)
    if r.status_code == 503:
        return Outcome(kind, UNAVAILABLE, 503, detail=message)
    if r.status_code >= 500:
        return Outcome(kind, SERVER_ERROR, r.status_code, detail=message)
    return Outcome(kind, INVALID, r.status_code, detail=f"a valid request refused: {message}")


def _post(
    ctx: Ctx, kind: str, path: str, body: dict[str, Any], dialect: str,
    check: Callable[[Any], int],
) -> Outcome:  # fmt: skip
    r = ctx.client.post(path, json=body)
    if r.status_code != 200:
        return _refused(kind, r, dialect)
    return Outcome(kind, OK, 200, cached=check(r.json()))


def _stream(
    ctx: Ctx, kind: str, path: str, body: dict[str, Any], dialect: str,
    check: Callable[[Stream], int], limit: int | None = None,
) -> Outcome:  # fmt: skip
    with ctx.client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return _refused(kind, r, dialect)
        kind_of = r.headers.get("content-type", "")
        ensure(kind_of.startswith("text/event-stream"), f"a stream typed {kind_of!r}")
        got = checks.read_stream(r, limit)
    # leaving the block closes the connection: a client cut off mid-stream
    return Outcome(kind, OK, 200, cached=check(got))


# -- OpenAI chat ---------------------------------------------------------------------------


def _chat_cached(usage: Any) -> int:
    details = usage.prompt_tokens_details if usage is not None else None
    return int(details.cached_tokens or 0) if details is not None else 0


def _chat(ctx: Ctx, kind: str, body: dict[str, Any], stream: bool, n: int = 1) -> Outcome:
    if not stream:
        return _post(ctx, kind, CHAT, body, "openai",
                     lambda b: _chat_cached(checks.chat_body(b, n).usage))  # fmt: skip

    def check(s: Stream) -> int:
        chunks = checks.chat_stream(s, n)
        return _chat_cached(chunks[-1].usage)

    body = {**body, "stream_options": {"include_usage": True}}
    return _stream(ctx, kind, CHAT, body, "openai", check)


def chat(ctx: Ctx, stream: bool) -> Outcome:
    body = {"model": ctx.model, "messages": ctx.prompts.messages(ctx.rng),
            "max_tokens": ctx.tokens(), "temperature": ctx.temperature()}  # fmt: skip
    return _chat(ctx, "chat_stream" if stream else "chat", body, stream)


def long_prompt(ctx: Ctx) -> Outcome:
    body = {"model": ctx.model, "messages": ctx.prompts.long(ctx.rng),
            "max_tokens": ctx.min_tokens, "temperature": 0.0}  # fmt: skip
    return _chat(ctx, "long", body, ctx.rng.random() < 0.5)


def n_choices(ctx: Ctx) -> Outcome:
    n = ctx.rng.choice((2, 3))
    body = {"model": ctx.model, "messages": ctx.prompts.messages(ctx.rng), "n": n,
            "max_tokens": ctx.min_tokens, "temperature": 0.8}  # fmt: skip
    return _chat(ctx, "n", body, ctx.rng.random() < 0.5, n)


def structured(ctx: Ctx) -> Outcome:
    n = ctx.rng.choice((1, 1, 2))
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "harbour", "schema": SCHEMA, "strict": True},
    }
    ask = "Report one harbour city, whether it rains there and how many ships are in, as JSON."
    body = {"model": ctx.model, "messages": [{"role": "user", "content": ask}], "n": n,
            "max_tokens": ctx.max_tokens, "temperature": ctx.temperature(),
            "response_format": fmt}  # fmt: skip
    if ctx.rng.random() < 0.5:

        def whole(b: Any) -> int:
            for choice in checks.chat_body(b, n).choices:
                checks.structured(choice.message.content, choice.finish_reason)
            return 0

        return _post(ctx, "structured", CHAT, body, "openai", whole)

    def streamed(s: Stream) -> int:
        chunks = checks.chat_stream(s, n)
        texts: dict[int, str] = {}
        finish: dict[int, str | None] = {}
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                finish[c.index] = c.finish_reason or finish.get(c.index)
        for i, text in texts.items():
            checks.structured(text, finish[i])
        return 0

    return _stream(ctx, "structured", CHAT, body, "openai", streamed)


def tools_openai(ctx: Ctx) -> Outcome:
    name = ctx.rng.choice([t["function"]["name"] for t in TOOLS_OPENAI])
    choice: Any = ctx.rng.choice(
        ["auto", "required", {"type": "function", "function": {"name": name}}]
    )
    body = {"model": ctx.tools_model, "messages": ctx.prompts.tool_messages(ctx.rng),
            "tools": TOOLS_OPENAI, "tool_choice": choice, "max_tokens": ctx.max_tokens,
            "temperature": ctx.temperature()}  # fmt: skip
    forced = choice != "auto"
    named = name if isinstance(choice, dict) else None

    def obeyed(finish: str | None, names: list[str]) -> None:
        if forced:
            ensure(finish in ("tool_calls", "length"), f"tool_choice {choice}: finish {finish}")
        if named is not None and finish == "tool_calls":
            ensure(set(names) == {named}, f"asked for {named}, called {names}")

    if ctx.rng.random() < 0.5:

        def whole(b: Any) -> int:
            body_ = checks.chat_body(b)
            c = body_.choices[0]
            obeyed(c.finish_reason, [t.function.name for t in c.message.tool_calls or []
                                     if t.type == "function"])  # fmt: skip
            return _chat_cached(body_.usage)

        return _post(ctx, "tools", CHAT, body, "openai", whole)

    def streamed(s: Stream) -> int:
        chunks = checks.chat_stream(s)
        finish = next((c.finish_reason for k in chunks for c in k.choices if c.finish_reason), None)
        names = [t.function.name for k in chunks for c in k.choices
                 for t in c.delta.tool_calls or [] if t.function and t.function.name]  # fmt: skip
        obeyed(finish, names)
        return 0

    return _stream(ctx, "tools", CHAT, body, "openai", streamed)


# -- Anthropic -------------------------------------------------------------------------------


def _message_cached(usage: Any) -> int:
    return int(getattr(usage, "cache_read_input_tokens", 0) or 0)


def _messages(ctx: Ctx, kind: str, body: dict[str, Any], stream: bool,
              also: Callable[[Any], None] = lambda _: None) -> Outcome:  # fmt: skip
    if not stream:

        def whole(b: Any) -> int:
            msg = checks.message_body(b)
            also(msg)
            return _message_cached(msg.usage)

        return _post(ctx, kind, MESSAGES, body, "anthropic", whole)

    def streamed(s: Stream) -> int:
        msg = checks.message_stream(s)
        also(msg)
        return _message_cached(msg.usage)

    return _stream(ctx, kind, MESSAGES, body, "anthropic", streamed)


def messages(ctx: Ctx, stream: bool) -> Outcome:
    system, turns = split_system(ctx.prompts.messages(ctx.rng))
    body: dict[str, Any] = {"model": ctx.model, "messages": turns, "max_tokens": ctx.tokens(),
                            "temperature": ctx.temperature()}  # fmt: skip
    if system is not None:
        body["system"] = system
    return _messages(ctx, "messages_stream" if stream else "messages", body, stream)


def tools_anthropic(ctx: Ctx) -> Outcome:
    name = ctx.rng.choice([t["name"] for t in TOOLS_ANTHROPIC])
    choice = ctx.rng.choice([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": name}])
    body = {"model": ctx.tools_model, "messages": ctx.prompts.tool_messages(ctx.rng),
            "tools": TOOLS_ANTHROPIC, "tool_choice": choice, "max_tokens": ctx.max_tokens}  # fmt: skip

    def obeyed(msg: Any) -> None:
        if choice["type"] != "auto":
            ensure(msg.stop_reason in ("tool_use", "max_tokens"),
                   f"tool_choice {choice}: stop_reason {msg.stop_reason}")  # fmt: skip
        if choice["type"] == "tool" and msg.stop_reason == "tool_use":
            used = {b.name for b in msg.content if b.type == "tool_use"}
            ensure(used == {name}, f"asked for {name}, used {used}")

    return _messages(ctx, "tools_anthropic", body, ctx.rng.random() < 0.5, obeyed)


# -- Responses -------------------------------------------------------------------------------


def _response_cached(usage: Any) -> int:
    return int(usage.input_tokens_details.cached_tokens or 0) if usage is not None else 0


def responses(ctx: Ctx, stream: bool) -> Outcome:
    system, turns = split_system(ctx.prompts.messages(ctx.rng))
    store = ctx.rng.random() < 0.7
    body: dict[str, Any] = {"model": ctx.model, "input": turns, "store": store,
                            "max_output_tokens": ctx.tokens()}  # fmt: skip
    if system is not None:
        body["instructions"] = system
    if ctx.last_response is not None and ctx.rng.random() < 0.3:
        body["previous_response_id"] = ctx.last_response  # continue a stored one
        body["input"] = turns[-1:]
    kind = "responses_stream" if stream else "responses"

    def keep(resp: Any) -> int:
        ctx.last_response = resp.id if store else ctx.last_response
        return _response_cached(resp.usage)

    if not stream:
        return _post(ctx, kind, RESPONSES, body, "openai", lambda b: keep(checks.response_body(b)))
    return _stream(ctx, kind, RESPONSES, body, "openai", lambda s: keep(checks.response_stream(s)))


# -- clients that leave, bodies that are wrong, bursts --------------------------------------


def disconnect(ctx: Ctx) -> Outcome:
    """A stream the client stops reading after a few events (and closes), or a plain
    request it gives up on before the answer."""
    rng = ctx.rng
    limit = rng.randint(1, 6)
    where = rng.choice(("chat", "messages", "responses", "plain"))
    turns = ctx.prompts.messages(rng)
    if where == "plain":
        body = {"model": ctx.model, "messages": turns, "max_tokens": ctx.max_tokens}
        try:
            r = ctx.client.post(CHAT, json=body, timeout=rng.uniform(0.2, 2.0))
        except httpx.TimeoutException:
            return Outcome("disconnect", OK, None, detail="gave up waiting")
        if r.status_code != 200:
            return _refused("disconnect", r, "openai")
        checks.chat_body(r.json())
        return Outcome("disconnect", OK, 200, detail="answered in time")
    if where == "chat":
        body = {"model": ctx.model, "messages": turns, "max_tokens": ctx.max_tokens}
        return _stream(ctx, "disconnect", CHAT, body, "openai",
                       lambda s: _partial(checks.chat_partial, s), limit)  # fmt: skip
    system, rest = split_system(turns)
    if where == "messages":
        body = {"model": ctx.model, "messages": rest, "max_tokens": ctx.max_tokens}
        if system is not None:
            body["system"] = system
        return _stream(ctx, "disconnect", MESSAGES, body, "anthropic",
                       lambda s: _partial(checks.message_partial, s), limit)  # fmt: skip
    body = {"model": ctx.model, "input": rest, "max_output_tokens": ctx.max_tokens}
    return _stream(ctx, "disconnect", RESPONSES, body, "openai",
                   lambda s: _partial(checks.response_partial, s), limit)  # fmt: skip


def _partial(check: Callable[[Stream], object], s: Stream) -> int:
    check(s)
    return 0


def _bad_bodies(model: str) -> list[tuple[str, bytes | dict[str, Any], str]]:
    """(path, body, what is wrong); bytes are sent as they are."""
    hi = [{"role": "user", "content": "hi"}]
    return [
        (CHAT, b'{"model": "' + model.encode() + b'", "messages": [', "truncated JSON"),
        (CHAT, b"model=smollm2&messages=hi", "not JSON"),
        (CHAT, b"\xff\xfe\x00{", "not UTF-8"),
        (CHAT, b"[]", "an array, not an object"),
        (CHAT, {"model": model, "messages": "hi"}, "messages not a list"),
        (CHAT, {"model": model, "messages": []}, "no messages"),
        (CHAT, {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}, "a bad role"),
        (CHAT, {"model": model, "messages": hi, "max_tokens": -5}, "negative max_tokens"),
        (CHAT, {"model": model, "messages": hi, "n": 0}, "n = 0"),
        (CHAT, {"model": model, "messages": hi, "temperature": "hot"}, "a string temperature"),
        (CHAT, {"model": "no-such-model", "messages": hi}, "an unknown model"),
        (CHAT, {"model": model, "messages": hi, "tools": [{"type": "function"}]}, "a nameless tool"),
        (CHAT, {"model": model, "messages": hi, "response_format": {"type": "json_schema"}},
         "json_schema without a schema"),
        (MESSAGES, b'{"model": "x", "max_tokens": 5, "messages": [{"role": "us', "truncated JSON"),
        (MESSAGES, {"model": model, "messages": hi}, "no max_tokens"),
        (MESSAGES, {"model": model, "max_tokens": 8, "messages": [
            {"role": "user", "content": [{"type": "hologram"}]}]}, "an unknown block type"),
        (MESSAGES, {"model": model, "max_tokens": "eight", "messages": hi}, "a string max_tokens"),
        (RESPONSES, {"model": model, "input": 5}, "a number as input"),
        (RESPONSES, {"model": model, "input": "hi", "max_output_tokens": "many"},
         "a string max_output_tokens"),
        (RESPONSES, {"model": model, "input": "hi", "previous_response_id": "resp_nope"},
         "an unknown previous_response_id"),
    ]  # fmt: skip


def malformed(ctx: Ctx) -> Outcome:
    path, body, what = ctx.rng.choice(_bad_bodies(ctx.model))
    dialect = "anthropic" if path == MESSAGES else "openai"
    if isinstance(body, bytes):
        r = ctx.client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = ctx.client.post(path, json=body)
    if r.status_code < 400:
        return Outcome("malformed", INVALID, r.status_code, detail=f"accepted {what}")
    message = checks.error_body(r, dialect)
    if r.status_code >= 500:
        return Outcome("malformed", SERVER_ERROR, r.status_code, detail=f"{what}: {message}")
    return Outcome("malformed", OK, r.status_code, detail=what)


def burst(ctx: Ctx) -> list[Outcome]:
    """More small requests at once than the queue holds: each is answered or gets 429."""
    body = {"model": ctx.model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": ctx.min_tokens}  # fmt: skip

    def one(_: int) -> Outcome:
        return run_one(ctx, "burst",
                       lambda c: _post(c, "burst", CHAT, body, "openai",
                                       lambda b: _chat_cached(checks.chat_body(b).usage)))  # fmt: skip

    with ThreadPoolExecutor(ctx.burst) as pool:
        return list(pool.map(one, range(ctx.burst)))


# -- the table of kinds ----------------------------------------------------------------------

Single = Callable[[Ctx], Outcome]
SINGLE: dict[str, Single] = {
    "chat": lambda c: chat(c, False),
    "chat_stream": lambda c: chat(c, True),
    "messages": lambda c: messages(c, False),
    "messages_stream": lambda c: messages(c, True),
    "responses": lambda c: responses(c, False),
    "responses_stream": lambda c: responses(c, True),
    "tools": tools_openai,
    "tools_anthropic": tools_anthropic,
    "long": long_prompt,
    "n": n_choices,
    "structured": structured,
    "disconnect": disconnect,
    "malformed": malformed,
}
# each kind's weight in the mix; a burst is rare (it sends `Ctx.burst` requests)
WEIGHTS: dict[str, float] = {
    "chat": 3.0, "chat_stream": 3.0, "messages": 2.0, "messages_stream": 2.0,
    "responses": 1.0, "responses_stream": 1.0, "tools": 1.5, "tools_anthropic": 1.0,
    "long": 0.5, "n": 1.0, "structured": 1.0, "disconnect": 1.5, "malformed": 1.5,
    "burst": 0.15,
}  # fmt: skip


def run_one(ctx: Ctx, kind: str, send: Single) -> Outcome:
    """One request's outcome, whatever happened to it."""
    began = time.monotonic()
    try:
        out = send(ctx)
    except Invalid as exc:
        out = Outcome(kind, INVALID, 200, detail=str(exc)[:300])
    except httpx.TransportError as exc:
        out = Outcome(kind, LOST, None, detail=f"{type(exc).__name__}: {exc}"[:300])
    except checks.FAILURES as exc:  # a check of the SDK types or of the protocol failed
        text = " ".join(str(exc).split())
        out = Outcome(kind, INVALID, 200, detail=f"{type(exc).__name__}: {text}"[:300])
    out.seconds = time.monotonic() - began
    return out


def run(ctx: Ctx, kind: str) -> list[Outcome]:
    if kind == "burst":
        return burst(ctx)
    return [run_one(ctx, kind, SINGLE[kind])]


def pick(rng: random.Random) -> str:
    names = list(WEIGHTS)
    return rng.choices(names, weights=[WEIGHTS[n] for n in names])[0]
