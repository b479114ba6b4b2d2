"""What one slow or crowding client can hold (issue 27), each bound answered in the
route's dialect with Retry-After:

- requests being prepared (rendered, tokenized, images fetched) beyond --max-preparing:
  429 `too_many_preparing`;
- connections beyond --max-connections: 503 `too_many_connections`;
- an image host that drips its headers or its body a byte at a time: cut off at the
  fetch's deadline (connect, headers and body together) with a 400, its connection
  closed and the preparation slot free again.

Every wait is for an event (the renderer entered, the drip server saw its client hang
up); nothing asserts how long anything took.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.core.image_fetch import ImagePolicy
from gateway.core.models.build import build_served
from gateway.core.models.served import ServedModel
from gateway.core.settings import EngineSettings, ServerSettings
from tests.support.anthropic_checks import check_error
from tests.support.live_server import live_server
from tests.support.openai_checks import error_of, post
from tests.support.scripted_engine import HANG_S, HoldNextCall, in_thread, scripted_served, wait_for

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Name three colors."}]
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
CHAT_BODY = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
MESSAGES_BODY = {"model": MODEL, "messages": HELLO, "max_tokens": 2}


def _retry_after(r: httpx.Response) -> None:
    assert int(r.headers["retry-after"]) >= 1, r.headers


# -- requests in preparation -------------------------------------------------------------------


@pytest.fixture(scope="module")
def preparing(smollm2_gguf: Path) -> Iterator[tuple[str, HoldNextCall]]:
    """A server that prepares one request at a time, whose renderer a test can hold."""
    holds: list[HoldNextCall] = []

    def load() -> ServedModel:
        served = scripted_served(smollm2_gguf, MODEL)
        holds.append(HoldNextCall(served.renderer))
        return dataclasses.replace(served, renderer=holds[-1])

    with live_server(load, ServerSettings(max_preparing=1)) as url:
        yield url, holds[0]


def test_requests_beyond_the_preparation_bound_get_429(
    preparing: tuple[str, HoldNextCall],
) -> None:
    url, hold = preparing
    hold.arm()
    first, answers = in_thread(lambda: post(url, CHAT, CHAT_BODY))
    wait_for(hold.entered, "the first request to be rendering")
    try:
        for path in (CHAT, "/v1/completions", "/tokenize"):
            body = {"model": MODEL, "prompt": "hi"} if path != CHAT else CHAT_BODY
            r = post(url, path, body)
            err = error_of(r, 429)
            assert err["code"] == "too_many_preparing" and "--max-preparing" in err["message"]
            _retry_after(r)
        for path in (MESSAGES, "/v1/messages/count_tokens"):
            r = post(url, path, MESSAGES_BODY)
            assert r.status_code == 429
            assert "--max-preparing" in check_error(r.json(), "rate_limit_error")
            _retry_after(r)
    finally:
        hold.release.set()
    first.join(HANG_S)
    assert answers[0].status_code == 200, answers[0].text
    assert post(url, CHAT, CHAT_BODY).status_code == 200  # the slot is free again


# -- open connections --------------------------------------------------------------------------


def _kept_alive(url: str) -> socket.socket:
    """A connection that has been served one request and stays open."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return sock


def _served_again(url: str) -> bool:
    """Whether /health answers 200 again once the server has seen connections close
    (it notices each within an event-loop turn): asked until it does."""
    deadline = time.monotonic() + HANG_S  # only a server that never notices waits this out
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/health").status_code == 200:
            return True
        time.sleep(0.01)
    return False


def test_connections_beyond_the_bound_get_503(smollm2_gguf: Path) -> None:
    settings = ServerSettings(max_connections=2)
    with live_server(lambda: scripted_served(smollm2_gguf, MODEL), settings) as url:
        held = [_kept_alive(url) for _ in range(2)]
        try:
            r = post(url, CHAT, CHAT_BODY)
            err = error_of(r, 503)
            assert err["code"] == "too_many_connections" and "--max-connections" in err["message"]
            assert r.headers["connection"] == "close"
            _retry_after(r)
            r = post(url, MESSAGES, MESSAGES_BODY)
            assert r.status_code == 503
            assert "--max-connections" in check_error(r.json(), "overloaded_error")
            _retry_after(r)
        finally:
            for sock in held:
                sock.close()
        assert _served_again(url)
        assert post(url, CHAT, CHAT_BODY).status_code == 200


# -- image hosts that drip ---------------------------------------------------------------------

VMODEL = "tiny-gemma3-vision"
FETCH_S = 1.0  # the test server's fetch deadline


class Drip:
    """An image host that answers one connection a byte at a time, for ever: its status
    line and headers ("head"), or a 100 kB body after prompt headers ("body").
    `closed` is set when the client hangs up; `gave_up` when HANG_S passed first."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.closed = threading.Event()
        self.gave_up = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        self.listener.close()
        with conn:
            conn.recv(65536)  # the GET
            if self.mode == "body":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n")
                conn.sendall(b"Content-Length: 100000\r\n\r\n")
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: ")
            started = time.monotonic()
            while time.monotonic() - started < HANG_S:
                # a byte every 50 ms, watching for the client's hang-up meanwhile
                readable, _, _ = select.select([conn], [], [], 0.05)
                try:
                    if readable and not conn.recv(1):
                        break
                    conn.sendall(b"a")
                except OSError:
                    break
            else:
                self.gave_up = True
                return
        self.closed.set()


@pytest.fixture(scope="module")
def vision_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tiny Gemma 3 with vision that fetches from loopback within FETCH_S, and
    prepares one request at a time (so a held slot would refuse the next request)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.runtime.models.test_models_vision import save_tiny_vision

    folder = tmp_path_factory.mktemp("vision")
    save_tiny_vision("pooled", folder)

    def load() -> ServedModel:
        served = build_served(
            folder, model_id=VMODEL, settings=EngineSettings(allow_private_urls=True)
        )
        policy = ImagePolicy(fetch_timeout=FETCH_S, allow_private=True)
        return dataclasses.replace(served, image_policy=policy)

    with live_server(load, ServerSettings(max_preparing=1)) as url:
        yield url


def _with_image(path: str, url: str) -> dict[str, Any]:
    if path == CHAT:
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    else:
        part = {"type": "image", "source": {"type": "url", "url": url}}
    content = [part, {"type": "text", "text": "w5"}]
    return {"model": VMODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("mode", ["head", "body"])
def test_an_image_host_that_drips_is_cut_off_at_the_deadline(
    vision_url: str, mode: str, path: str
) -> None:
    drip = Drip(mode)
    r = post(vision_url, path, _with_image(path, f"http://127.0.0.1:{drip.port}/cat.png"))
    if path == CHAT:
        err = error_of(r, 400)
        message = err["message"]
        assert err["code"] == "image_fetch_failed"
    else:
        assert r.status_code == 400, r.text
        message = check_error(r.json(), "invalid_request_error")
    assert f"took longer than {FETCH_S:g} s" in message, message
    wait_for(drip.closed, "the fetch to hang up")
    assert not drip.gave_up
    # the worker thread and the one preparation slot are free: the next request is served
    text = {"model": VMODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "w5"}]}
    assert post(vision_url, CHAT, text).status_code == 200
