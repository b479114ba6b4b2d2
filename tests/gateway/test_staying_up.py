"""Staying up: the engine's watchdog and the SIGTERM drain, end to end.

- A fault injected into the real runner kills the engine's worker mid-generation: the
  running requests get 503s (OpenAI and Anthropic shapes, streamed or not), /health
  says `engine_failed`, and after the restart the same prompt gives the same tokens.
- A runner whose step hangs: the watchdog fails its requests with 503s, /health says
  `stalled`, and a fresh worker starts once the hung step returns.
- `mlx-gateway serve` in a subprocess, SIGTERM during long streams: new requests get
  503s, a short generation still finishes, the long ones end with a final error event
  after the grace period, and the process exits 0; a second SIGTERM exits at once.

Bounds on time here are generous (a shared 2-core machine); nothing is timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.core.models.build import build_served
from gateway.core.models.served import ServedModel
from runtime.engine import BatchRunner, Engine, RequestHandle, Runner
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load import LoadedModel
from runtime.types import Finished, FinishReason, GenerationStats, TextDelta
from tests.support.anthropic_checks import check_error, read_events
from tests.support.live_server import free_port, live_server
from tests.support.openai_checks import SSE, chat_body, error_of, post, stream

MODEL = "tiny-qwen3"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
HELLO = [{"role": "user", "content": "hi"}]
LONG = 60_000  # tokens: minutes of generation, far beyond any test's wait
WAIT_S = 120.0  # the generous bound on anything that should happen "soon"


def _chat(max_tokens: int) -> dict[str, Any]:
    """A greedy request, the same body for both dialects."""
    return {"model": MODEL, "messages": HELLO, "max_tokens": max_tokens, "temperature": 0}


def _health(url: str, path: str = "/health") -> httpx.Response:
    return httpx.get(f"{url}{path}", timeout=30)


def _wait_health(url: str, what: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = _health(url).json()
        if done(body):
            return body
        time.sleep(0.05)
    raise AssertionError(f"/health never showed {what}: {body}")


def _served_with(
    path: Path,
    make_runner: Callable[[ServedModel], Runner | BatchRunner],
    *,
    stall_seconds: float = 300.0,
    restart_delay: float = 1.0,
) -> ServedModel:
    """The tiny model served by an engine over `make_runner(served)`."""
    served = build_served(path, model_id=MODEL)
    runner = make_runner(served)
    engine = Engine(runner, stall_seconds=stall_seconds, restart_delay=restart_delay)
    model_runner = runner if isinstance(runner, ModelRunner) else None
    return dataclasses.replace(served, engine=engine, runner=model_runner)


def _assert_engine_failed_503(r: httpx.Response, dialect: str) -> str:
    assert int(r.headers["retry-after"]) >= 1
    if dialect == "anthropic":
        assert r.status_code == 503, r.text
        return check_error(r.json(), "overloaded_error")
    err = error_of(r, 503)
    assert err["code"] == "engine_failed" and err["type"] == "overloaded_error"
    return str(err["message"])


# -- a fault kills the worker --------------------------------------------------------------


class FaultyRunner(ModelRunner):
    """The real runner (over a disk tier in `directory`, if given), with a fault to
    inject: the next step raises."""

    def __init__(self, served: ServedModel, directory: Path | None = None) -> None:
        assert isinstance(served.loaded, LoadedModel)  # a chat model
        super().__init__(
            served.loaded, RunnerSettings(prefill_chunk=256, prefix_cache_dir=directory)
        )
        self.fault = threading.Event()

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        if self.fault.is_set():
            self.fault.clear()
            raise RuntimeError("injected fault")
        return super().step()


@pytest.fixture
def faulty(tiny_qwen3_dir: Path) -> Iterator[tuple[str, FaultyRunner]]:
    runners: list[FaultyRunner] = []

    def make(served: ServedModel) -> FaultyRunner:
        runners.append(FaultyRunner(served))
        return runners[0]

    # a restart delay long enough to look at the failed state before the restart
    with live_server(lambda: _served_with(tiny_qwen3_dir, make, restart_delay=8.0)) as url:
        yield url, runners[0]


def test_a_dead_worker_fails_its_requests_with_503s_and_restarts(
    faulty: tuple[str, FaultyRunner],
) -> None:
    url, runner = faulty
    before = chat_body(post(url, CHAT, _chat(8))).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:
        openai_plain = pool.submit(post, url, CHAT, _chat(LONG))
        anthropic_plain = pool.submit(post, url, MESSAGES, _chat(LONG))
        openai_sse = pool.submit(stream, url, CHAT, _chat(LONG))
        anthropic_sse = pool.submit(read_events, url, _chat(LONG))
        _wait_health(url, "four running", lambda h: h["running"] == 4)
        runner.fault.set()
        assert "injected fault" in _assert_engine_failed_503(openai_plain.result(), "openai")
        assert "injected fault" in _assert_engine_failed_503(anthropic_plain.result(), "anthropic")
        sse = openai_sse.result()
        events = anthropic_sse.result()
    # the streams had begun: each ends with its dialect's error event, not a cut connection
    assert sse.status == 200 and sse.done and sse.errors[-1]["error"]["code"] == "engine_failed"
    assert events.names[-1] == "error"
    assert "injected fault" in check_error(events.named("error")[-1], "overloaded_error")

    health = _health(url)
    assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1
    body = health.json()
    assert body["state"] == "engine_failed" and body["live"] and not body["ready"]
    assert body["engine_failures"] == 1 and "injected fault" in body["last_engine_failure"]
    assert _health(url, "/health/ready").status_code == 503
    assert _health(url, "/health/live").status_code == 200
    # while it restarts, a new request is refused the same way, not queued
    refused = post(url, MESSAGES, _chat(4))
    assert "restarting" in _assert_engine_failed_503(refused, "anthropic")

    body = _wait_health(url, "the restart", lambda h: h["state"] == "ready")
    assert body["engine_restarts"] == 1 and body["status"] == "ok"
    assert _health(url, "/health/ready").json() == {"ready": True, "state": "ready"}
    # the model stayed loaded and the reset left no stale state: same prompt, same tokens,
    # and the emptied prefix cache fills again
    after = chat_body(post(url, CHAT, _chat(8))).choices[0].message.content
    assert after == before
    again = chat_body(post(url, CHAT, _chat(8)))
    assert again.choices[0].message.content == before
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 0
    check = post(url, MESSAGES, _chat(4))
    assert check.status_code == 200 and check.json()["stop_reason"] == "max_tokens"


# -- a stalled worker ----------------------------------------------------------------------


class HangingRunner:
    """A BatchRunner stand-in (no model): each step gives every running request one
    token; while `free` is clear a step hangs, as a stuck device call would."""

    def __init__(self) -> None:
        self.rows: dict[RequestHandle, int] = {}
        self.free = threading.Event()
        self.free.set()
        self.hung = threading.Event()
        self.resets = 0

    @property
    def idle(self) -> bool:
        return not self.rows

    def has_room(self) -> bool:
        return len(self.rows) < 8

    def admit(self, handle: RequestHandle) -> None:
        self.rows[handle] = 0

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        if not self.free.is_set():
            self.hung.set()
            self.free.wait(WAIT_S)
        ended = []
        for handle, n in list(self.rows.items()):
            reason = FinishReason.CANCELLED if handle.cancelled else None
            if reason is None:
                handle.emit(TextDelta("t ", (n,)))
                self.rows[handle] = n = n + 1
                reason = FinishReason.LENGTH if n >= handle.request.max_tokens else None
            if reason is not None:
                del self.rows[handle]
                ended.append((handle, self._finished(handle, reason, n)))
        time.sleep(0.005)
        return ended

    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]:
        self.resets += 1
        ended = [(h, self._finished(h, reason, n, error)) for h, n in self.rows.items()]
        self.rows.clear()
        return ended

    def load(self) -> tuple[int, int, int, float]:
        return len(self.rows), 0, 0, 0.0

    @staticmethod
    def _finished(
        handle: RequestHandle, reason: FinishReason, n: int, error: str | None = None
    ) -> Finished:
        return Finished(reason, GenerationStats(len(handle.request.prompt_tokens), n), error)


@pytest.fixture
def hanging(tiny_qwen3_dir: Path) -> Iterator[tuple[str, HangingRunner]]:
    runner = HangingRunner()

    def load() -> ServedModel:
        return _served_with(tiny_qwen3_dir, lambda _: runner, stall_seconds=1.0)

    with live_server(load) as url:
        try:
            yield url, runner
        finally:
            runner.free.set()


def test_a_stalled_worker_fails_its_requests_and_restarts_when_it_returns(
    hanging: tuple[str, HangingRunner],
) -> None:
    url, runner = hanging
    with ThreadPoolExecutor(2) as pool:
        openai_plain = pool.submit(post, url, CHAT, _chat(LONG))
        anthropic_plain = pool.submit(post, url, MESSAGES, _chat(LONG))
        _wait_health(url, "two running", lambda h: h["running"] == 2)
        runner.free.clear()
        assert runner.hung.wait(WAIT_S)
        assert "stalled" in _assert_engine_failed_503(openai_plain.result(), "openai")
        assert "stalled" in _assert_engine_failed_503(anthropic_plain.result(), "anthropic")

    health = _health(url)
    body = health.json()
    assert health.status_code == 503 and body["state"] == "stalled" and body["busy"]
    assert body["engine_failures"] == 1 and "stalled" in body["last_engine_failure"]
    assert body["heartbeat_age_seconds"] >= 1.0  # the hung step, not an idle worker
    assert _health(url, "/health/ready").json() == {"ready": False, "state": "stalled"}
    # no second worker while the first may still be inside the device call
    assert "stalled" in _assert_engine_failed_503(post(url, CHAT, _chat(3)), "openai")
    assert runner.resets == 0

    runner.free.set()  # the hung step returns: that worker resets the runner and leaves
    body = _wait_health(url, "the restart", lambda h: h["state"] == "ready")
    assert body["engine_restarts"] == 1 and runner.resets >= 1 and not runner.rows
    reply = chat_body(post(url, CHAT, _chat(3)))
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content


# -- SIGTERM drain of `mlx-gateway serve` ----------------------------------------------------


class Server:
    """`mlx-gateway serve` on a free port, its output in a log file."""

    def __init__(self, model: Path, log: Path, grace: float) -> None:
        script = Path(sys.executable).with_name("mlx-gateway")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli.main"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = ["--log-level", "info", "serve", "--model", str(model), "--port", str(self.port)]
        args += ["--model-id", MODEL, "--shutdown-grace", str(grace)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_GATEWAY_")}
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [*command, *args], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited early:\n{self.tail()}"
            try:
                if _health(self.url, "/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve never became ready:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def serve(tiny_qwen3_dir: Path, tmp_path: Path) -> Iterator[Callable[[float], Server]]:
    started: list[Server] = []

    def start(grace: float) -> Server:
        server = Server(tiny_qwen3_dir, tmp_path / f"serve-{len(started)}.log", grace)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


def _stream_started(pool: ThreadPoolExecutor, url: str, body: dict[str, Any]) -> Future[SSE]:
    """An OpenAI stream read in the pool; returns once its first content has arrived."""
    first = threading.Event()

    def run() -> SSE:
        out = SSE(0)
        with httpx.stream(
            "POST", f"{url}{CHAT}", json={**body, "stream": True}, timeout=WAIT_S
        ) as r:
            out.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        out.done = True
                    else:
                        out.data.append(json.loads(payload))
                    if len(out.data) > 1:  # the role chunk, then content
                        first.set()
        first.set()
        return out

    future = pool.submit(run)
    assert first.wait(WAIT_S)
    assert not future.done() or future.result().status == 200, future.result()
    return future


def test_sigterm_drains_then_exits_zero(serve: Callable[[float], Server]) -> None:
    grace = 8.0
    server = serve(grace)
    url = server.url
    with ThreadPoolExecutor(3) as pool:
        long_one = _stream_started(pool, url, _chat(LONG))
        anthropic_long = pool.submit(read_events, url, _chat(LONG))
        _wait_health(url, "two running", lambda h: h["running"] == 2)
        short_one = _stream_started(pool, url, _chat(40))
        server.proc.send_signal(signal.SIGTERM)
        # new requests are refused with a 503 to retry, in each dialect's shape
        refused = _wait_refused(url)
        err = error_of(refused, 503)
        assert err["code"] == "shutting_down" and int(refused.headers["retry-after"]) >= 1
        r = post(url, MESSAGES, _chat(4))
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "shutting down" in check_error(r.json(), "overloaded_error")
        ready = _health(url, "/health/ready")
        assert ready.status_code == 503 and ready.json()["state"] == "draining"
        assert _health(url, "/health/live").status_code == 200

        # the drain answers each one (the waits only guard against a hang)
        short, long_sse = short_one.result(grace + WAIT_S), long_one.result(grace + WAIT_S)
        events = anthropic_long.result(grace + WAIT_S)
    # the short one finished within the grace; the long ones got a final event after it
    assert short.done and short.data[-1]["choices"][0]["finish_reason"] == "length"
    assert long_sse.done and "shutting down" in long_sse.errors[-1]["error"]["message"]
    assert events.names[-1] == "error"
    assert "shutting down" in check_error(events.named("error")[-1], "overloaded_error")
    assert server.proc.wait(WAIT_S) == 0, server.tail()
    assert "requests still running after" in server.tail()


def _wait_refused(url: str) -> httpx.Response:
    """The first request after the signal that the server answers: the handler runs
    between bytecodes, so a request sent at once may still get in."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r = post(url, CHAT, _chat(4))
        if r.status_code == 503:
            return r
        time.sleep(0.05)
    raise AssertionError("new requests were never refused")


def test_a_second_sigterm_exits_at_once(serve: Callable[[float], Server]) -> None:
    server = serve(600.0)  # a drain that would outlast the test
    with ThreadPoolExecutor(1) as pool:
        long_one = _stream_started(pool, server.url, _chat(LONG))
        server.proc.send_signal(signal.SIGTERM)
        _wait_refused(server.url)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(WAIT_S) == 128 + signal.SIGTERM, server.tail()
        with pytest.raises(httpx.TransportError):
            long_one.result()  # cut: the forced exit does not wait for anything
    assert "second SIGTERM: exiting now" in server.tail()
