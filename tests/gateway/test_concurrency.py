"""Concurrency and disconnects against a live SmolLM2 server: concurrent greedy requests
give their solo outputs in arrival order, and clients that leave at any moment (queued,
mid-prefill, mid-decode) cancel their generation, which the engine drops (within a prefill
chunk or a decode step) instead of running it to the end.

Every wait is for an event the server reports (/health, /metrics, the stream itself); its
deadline only guards against a hang, so a slow machine makes the tests slower, never wrong."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.core.models.build import build_served
from gateway.core.settings import EngineSettings
from tests.support.live_server import live_server
from tests.support.openai_checks import chat_body, chat_chunks, chat_texts, post, stream

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
PREFILL_CHUNK = 64
TOPICS = ["colors", "fruits", "planets", "rivers", "birds", "metals", "games", "trees"]
HANG_S = 120.0  # only a hang takes this long


@pytest.fixture(scope="module")
def base_url(smollm2_gguf: Path) -> Iterator[str]:
    # small prefill chunks: a cancelled prefill must stop within one of them
    settings = EngineSettings(prefill_chunk=PREFILL_CHUNK)
    with live_server(lambda: build_served(smollm2_gguf, model_id=MODEL, settings=settings)) as url:
        yield url


def _req(topic: str, max_tokens: int = 8) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Name three {topic}."}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


async def _chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[str, float]:
    r = await client.post(f"{url}{CHAT}", json=body)
    text = chat_body(r).choices[0].message.content or ""
    return text, time.monotonic()


async def _chat_streamed(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[str, float]:
    text = ""
    async with client.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                for choice in httpx.Response(200, content=line[5:]).json()["choices"]:
                    text += choice["delta"].get("content") or ""
    return text, time.monotonic()


def _health(url: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{url}/health").json()
    return data


def _wait_health(url: str, what: str, ready: Callable[[dict[str, Any]], bool]) -> None:
    """Polls /health until `ready(health)`."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        if ready(_health(url)):
            return
        time.sleep(0.01)
    raise AssertionError(f"/health never showed {what}: {_health(url)}")


def _idle(health: dict[str, Any]) -> bool:
    return not health["busy"] and health["queue_depth"] == 0


def _wait_idle(url: str) -> None:
    _wait_health(url, "an idle engine", _idle)


def _engine_counts(url: str) -> dict[str, float]:
    names = {
        "mlx_gateway_generations_total": "total",
        "mlx_gateway_generations_cancelled_total": "cancelled",
        "mlx_gateway_generations_failed_total": "failed",
        "mlx_gateway_completion_tokens_total": "completion",
    }
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            counts[names[name]] = float(value)
    return counts


def _assert_dropped(url: str, before: dict[str, float], max_tokens: int) -> None:
    """Once the engine is idle again: the one generation whose client left was counted
    cancelled, and it wrote fewer tokens than it was allowed (it did not run to the end)."""
    _wait_idle(url)
    after = _engine_counts(url)
    assert after["cancelled"] - before["cancelled"] == 1, (before, after)
    assert after["failed"] == before["failed"]
    assert after["completion"] - before["completion"] < max_tokens, (before, after)


async def _wait_taken(client: httpx.AsyncClient, url: str, count: int) -> None:
    """Until the engine has taken `count` generations and none is still reading its
    prompt (the event loop stays free to finish the earlier requests meanwhile)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        health = (await client.get(f"{url}/health")).json()
        if health["requests_total"] >= count and health["prefilling"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine never took {count} generations")


def test_concurrent_greedy_requests_equal_solo_in_arrival_order(base_url: str) -> None:
    solo = [chat_body(post(base_url, CHAT, _req(t))).choices[0].message.content for t in TOPICS]

    async def together() -> list[tuple[str, float]]:
        async with httpx.AsyncClient(timeout=300) as client:
            taken = int(_health(base_url)["requests_total"])
            tasks = []
            for i, topic in enumerate(TOPICS):
                call = _chat_streamed if i % 2 else _chat
                tasks.append(asyncio.ensure_future(call(client, base_url, _req(topic))))
                # a clear arrival order: the next is sent once the engine took this one
                # and read its prompt, so this one is ahead by at least a step
                await _wait_taken(client, base_url, taken + i + 1)
            return list(await asyncio.gather(*tasks))

    results = asyncio.run(together())
    assert [text for text, _ in results] == solo
    finished = [at for _, at in results]
    assert finished == sorted(finished), "served in arrival order"


CROWD = 50
STAYING = 5  # clients that never leave: they read their whole answer
MAX_BATCH = EngineSettings().max_batch  # the fixture's engine keeps the default
LEAVER_TOKENS = 1000  # far more than any client reads before it leaves


def _without_ends(url: str) -> dict[str, int]:
    """A logit_bias that bans the end-of-turn tokens: a decode then runs to max_tokens."""
    ends = httpx.post(f"{url}/tokenize", json={"prompt": "<|im_end|><|endoftext|>"}).json()
    return {str(t): -100 for t in ends["tokens"]}


def _has_content(line: str) -> bool:
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return False
    choices = json.loads(line[5:])["choices"]
    return any(c["delta"].get("content") for c in choices)


def _long(i: int) -> bool:
    """Whether client `i` sends a long prompt (its prefill takes many chunks)."""
    return i % 5 == 0


def _plan(rng: random.Random) -> list[tuple[str, int]]:
    """Each client's moment to leave, as (event, count). A blocking client (even index)
    leaves once the engine has taken `count` of the crowd's generations (`taken`); a
    streaming one once its answer began (`began`) or after `count` tokens (`tokens`);
    `stay` never leaves. A long prompt leaves at the first `taken` (it may be the one
    being read) or as its answer begins, so nobody waits for a long prefill. No `taken`
    count exceeds a batch, and the clients that stay or wait for tokens (who cannot leave
    before the engine takes them) fill one: every `taken` comes without a blocking client
    leaving, so no client waits on one waiting on it."""
    staying = set(rng.sample([i for i in range(CROWD) if not _long(i)], STAYING))
    plan = []
    for i in range(CROWD):
        if i in staying:
            plan.append(("stay", 0))
        elif i % 2 == 0:
            plan.append(("taken", 1 if _long(i) else rng.randint(1, MAX_BATCH)))
        elif _long(i) or rng.random() < 0.3:
            plan.append(("began", 0))
        else:
            plan.append(("tokens", rng.randint(1, 4)))
    assert sum(event in ("stay", "tokens") for event, _ in plan) >= MAX_BATCH, plan
    return plan


class _Taken:
    """How many of the crowd's generations the engine has taken, from /health: one poller
    for the whole crowd, which the blocking clients wait on."""

    def __init__(self, url: str, before: int) -> None:
        self.url, self.before = url, before
        self.reached = {count: asyncio.Event() for count in range(1, MAX_BATCH + 1)}

    async def watch(self, client: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + HANG_S
        while not all(e.is_set() for e in self.reached.values()):
            assert time.monotonic() < deadline, f"the engine never took {MAX_BATCH} generations"
            taken = (await client.get(f"{self.url}/health")).json()["requests_total"]
            for count, event in self.reached.items():
                if taken - self.before >= count:
                    event.set()
            await asyncio.sleep(0.01)


async def _stream_until(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], tokens: int
) -> str:
    """A streaming client that leaves after `tokens` tokens (0: as soon as its answer began)."""
    async with client.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        if tokens == 0:
            return "left"  # leaving the block closes the connection
        seen = 0
        async for line in r.aiter_lines():
            seen += _has_content(line)
            if seen == tokens:
                return "left"
    return "finished"


async def _post_until(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], moment: asyncio.Event
) -> str:
    """A blocking client that leaves at `moment`, with its request still unanswered."""
    call = asyncio.ensure_future(client.post(f"{url}{CHAT}", json=body))
    wait = asyncio.ensure_future(moment.wait())
    done, _ = await asyncio.wait({call, wait}, return_when=asyncio.FIRST_COMPLETED)
    if call in done:
        wait.cancel()
        chat_body(call.result())
        return "finished"
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    return "left"


async def _client(
    url: str, i: int, leave: tuple[str, int], taken: _Taken, bias: dict[str, int]
) -> str:
    """One client of the crowd: queued, prefilling or decoding when its moment comes."""
    body = _req(TOPICS[i % len(TOPICS)] + " and their uses" * (i % 3), max_tokens=24)
    if _long(i):
        body["messages"][0]["content"] += (
            " " + "Think about it carefully. " * 60
        )  # a longer prefill
    event, count = leave
    if event != "stay":  # a leaver's generation cannot end before its client leaves
        body = {**body, "max_tokens": LEAVER_TOKENS, "logit_bias": bias}
    async with httpx.AsyncClient(timeout=HANG_S) as client:
        if event == "stay":
            call = _chat_streamed if i % 2 else _chat
            await call(client, url, body)
            return "finished"
        if event == "taken":
            return await _post_until(client, url, body, taken.reached[count])
        return await _stream_until(client, url, body, count if event == "tokens" else 0)


def test_fifty_clients_leaving_at_random_leave_the_engine_idle(base_url: str) -> None:
    """Fifty clients, each leaving at a moment of its own drawn from the seed (see _plan):
    a leaver asks for far more tokens than it reads and cannot stop early, so it is still
    unanswered when it leaves, however fast the machine."""
    expected = chat_body(post(base_url, CHAT, _req("colors"))).choices[0].message.content
    plan = _plan(random.Random(5))
    bias = _without_ends(base_url)

    async def crowd() -> list[str]:
        async with httpx.AsyncClient(timeout=HANG_S) as client:
            progress = _Taken(base_url, int(_health(base_url)["requests_total"]))
            clients = [_client(base_url, i, leave, progress, bias) for i, leave in enumerate(plan)]
            watcher = asyncio.ensure_future(progress.watch(client))
            outcomes = await asyncio.gather(*clients)
            await watcher  # raises if the engine never took a batch
            return outcomes

    before = _engine_counts(base_url)
    outcomes = asyncio.run(crowd())
    assert outcomes == ["finished" if event == "stay" else "left" for event, _ in plan]
    assert outcomes.count("left") >= 40
    _wait_idle(base_url)
    after = _engine_counts(base_url)
    taken, cancelled, failed = (after[k] - before[k] for k in ("total", "cancelled", "failed"))
    assert failed == 0 and cancelled >= 1 and taken <= 50
    # a client that left took its generation with it: the engine ran to the end only the
    # generations of clients still there (a few may end just as their client leaves;
    # a client that leaves while its request is rendered never reaches the engine)
    completed = taken - cancelled
    assert completed - outcomes.count("finished") <= 5, (taken, cancelled, outcomes)
    # still serving, and still right
    assert chat_body(post(base_url, CHAT, _req("colors"))).choices[0].message.content == expected
    assert chat_texts(chat_chunks(stream(base_url, CHAT, _req("colors"))))[0] == expected


def _long_prompt(tag: str) -> dict[str, Any]:
    text = f"{tag}: " + " ".join(f"item {i} is {TOPICS[i % 8]}." for i in range(150))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 200,
        "temperature": 0,
    }


def test_leaving_mid_prefill_frees_the_engine_within_a_chunk(base_url: str) -> None:
    body = _long_prompt("prefill")
    _wait_idle(base_url)
    before = _engine_counts(base_url)
    with httpx.stream("POST", f"{base_url}{CHAT}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        # inside a prefill of about a thousand tokens: leave now
        _wait_health(base_url, "a prompt being read", lambda h: h["prefilling"] >= 1)
        assert _health(base_url)["busy"]
    # the engine checks the cancel flag between chunks of PREFILL_CHUNK tokens
    _assert_dropped(base_url, before, body["max_tokens"])


def test_leaving_mid_decode_frees_the_engine_within_a_step(base_url: str) -> None:
    # the end-of-turn tokens banned, so the decode runs for all of max_tokens
    body = {**_req("colors", max_tokens=1000), "logit_bias": _without_ends(base_url)}
    _wait_idle(base_url)
    before = _engine_counts(base_url)
    with httpx.stream("POST", f"{base_url}{CHAT}", json={**body, "stream": True}, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data:") and '"content":""' not in line.replace(" ", ""):
                seen += 1
                if seen == 3:
                    assert _health(base_url)["busy"]
                    break  # leaving the loop early closes the connection
        assert seen == 3
    _assert_dropped(base_url, before, body["max_tokens"])


def test_non_streaming_client_leaving_frees_the_engine(base_url: str) -> None:
    body = _long_prompt("blocking")
    _wait_idle(base_url)
    before = _engine_counts(base_url)

    async def leave() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.ensure_future(client.post(f"{base_url}{CHAT}", json=body))
            deadline = time.monotonic() + HANG_S
            # the engine is running it (reading its prompt or writing): leave now
            while not (await client.get(f"{base_url}/health")).json()["busy"]:
                assert time.monotonic() < deadline, "the engine never started the request"
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave())
    _assert_dropped(base_url, before, body["max_tokens"])
