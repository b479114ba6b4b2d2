"""Faults, end to end, each on a real `mlx-gateway serve` process or a live app:

- kill -9 in the middle of a prefix-cache disk write (tests/support/fault_serve.py stops the
  writer mid-file, so the kill lands there every time), then a restart on the same
  directory: the server starts, deletes the partial file, loads no corrupt entry (none is
  even found), and its first requests hit on the intact files with the tokens they got
  before the kill. Once while memory spills to disk, once during a SIGTERM's flush.
- a model file truncated on disk (a safetensors shard, a GGUF cut in half): `serve` ends
  with one line naming the file (exit 1, no traceback anywhere); served beside other
  models, a request for it gets a clear error in each dialect, streamed or not, and the
  other model goes on serving.
- the engine's worker killed by an injected fault with the disk tier on: after the restart
  the trie comes back from disk, so the conversation from before the fault hits, with the
  same tokens. (The 503s and /health states of a fault, a stall and SIGTERM are covered
  by tests/gateway/test_staying_up.py; this adds the disk tier across the restart.)

Waits are generous bounds (a shared 2-core machine); nothing is timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.numpy import load_file, save_file

from gateway.core.models.build import build_served
from gateway.core.models.served import ServedModel
from runtime.engine import Engine
from runtime.prefix.disk.files import SUFFIX, TMP_SUFFIX, BadEntry, read_header
from tests.gateway.test_staying_up import FaultyRunner
from tests.support.anthropic_checks import check_error, check_message, check_stream, read_events
from tests.support.fault_serve import STALLED
from tests.support.live_server import free_port, live_server
from tests.support.openai_checks import chat_body, chat_chunks, chat_texts, error_of, post, stream

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3"
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
WAIT_S = 180.0
SYSTEM = (
    "You are a careful assistant for a harbour office. Answer in short sentences, name "
    "the tide tables you used, and never guess a ship's position. " * 6
)
PROMPTS = {
    "sea": "Which ships leave before the evening tide?",
    "rope": "How should the mooring ropes be checked after a storm?",
    "crane": "List the cranes that are free tomorrow morning.",
    "dock": "Who holds the keys to the dry dock?",
}


def _chat(prompt: str, max_tokens: int = 8, model: str = MODEL) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def _reply(url: str, name: str) -> tuple[str, int]:
    """A prompt's greedy reply and the prompt tokens the server reused."""
    body = chat_body(post(url, CHAT, _chat(PROMPTS[name])))
    usage = body.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    text = body.choices[0].message.content or ""
    return text, usage.prompt_tokens_details.cached_tokens or 0


def _cache_stats(url: str) -> dict[str, int]:
    r = httpx.get(f"{url}/debug/prefix-cache", timeout=WAIT_S)
    assert r.status_code == 200, r.text
    stats: dict[str, int] = r.json()["stats"]
    return stats


class Serve:
    """`mlx-gateway <argv>` (or another launcher) on a free port, its output in a file."""

    def __init__(self, argv: list[str], log: Path, launcher: list[str] | None = None) -> None:
        script = Path(sys.executable).with_name("mlx-gateway")
        command = launcher or (
            [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli.main"]
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_GATEWAY_")}
        env["PYTHONPATH"] = str(ROOT)
        args = ["--log-level", "info", *argv, "--port", str(self.port)]
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [*command, *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> Serve:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited early:\n{self.text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=30).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve never became ready:\n{self.text()[-3000:]}")

    def wait_log(self, needle: str) -> str:
        """The first log line holding `needle`, once it appears."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for line in self.text().splitlines():
                if needle in line:
                    return line
            assert self.proc.poll() is None, f"serve exited:\n{self.text()[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} never appeared:\n{self.text()[-3000:]}")

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(WAIT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def servers() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for server in started:
        server.kill()


# -- kill -9 during a disk-tier write ------------------------------------------------------


def _serve_args(model: Path, cache_dir: Path) -> list[str]:
    # a one-byte memory budget: every prefix paged out of memory goes to disk
    return ["serve", "--model", str(model), "--model-id", MODEL,
            "--prefix-cache-dir", str(cache_dir), "--prefix-cache-bytes", "1"]  # fmt: skip


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*" + SUFFIX))


@dataclasses.dataclass(frozen=True)
class Written:
    """A cache directory a clean run left, and the replies that run gave."""

    directory: Path
    replies: dict[str, str]


@pytest.fixture(scope="module")
def written(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Written]:
    """Two conversations, the first spilled to disk by the second, the second written by
    a clean SIGTERM."""
    root = tmp_path_factory.mktemp("written")
    server = Serve(_serve_args(tiny_qwen3_dir, root / "cache"), root / "serve.log")
    try:
        server.wait_ready()
        replies = {name: _reply(server.url, name)[0] for name in ("sea", "rope")}
        assert server.terminate() == 0, server.text()[-3000:]
    finally:
        server.kill()
    assert len(_entries(root / "cache")) >= 2 and not list(root.rglob("*" + TMP_SUFFIX))
    yield Written(root / "cache", replies)


@pytest.mark.parametrize(("when", "fraction"), [("spill", 0.5), ("shutdown", 1.0)])
def test_kill_9_during_a_disk_write_then_restart(
    when: str, fraction: float, written: Written, tiny_qwen3_dir: Path, tmp_path: Path,
    servers: list[Serve],
) -> None:  # fmt: skip
    cache = tmp_path / "cache"
    shutil.copytree(written.directory, cache)
    entries = _entries(cache)
    launcher = [sys.executable, "-m", "tests.support.fault_serve", str(fraction)]
    args = _serve_args(tiny_qwen3_dir, cache)
    doomed = Serve(args, tmp_path / "doomed.log", launcher)
    servers.append(doomed.wait_ready())
    crane = _reply(doomed.url, "crane")[0]
    if when == "spill":
        _reply(doomed.url, "dock")  # pages the crane conversation out: to disk
    else:
        doomed.proc.send_signal(signal.SIGTERM)  # the clean shutdown writes what is live
    line = doomed.wait_log(STALLED)
    doomed.proc.send_signal(signal.SIGKILL)
    assert doomed.proc.wait(WAIT_S) == -signal.SIGKILL

    [partial] = list(cache.rglob("*" + TMP_SUFFIX))
    assert str(partial) in line and _entries(cache) == entries  # nothing was renamed
    full = int(line.rsplit("(", 1)[1].split()[0])
    assert partial.stat().st_size == int(full * fraction)
    if fraction < 1:
        with pytest.raises(BadEntry):
            read_header(partial, "any")  # cut mid-file: unreadable

    again = Serve(args, tmp_path / "again.log")
    servers.append(again.wait_ready())
    assert not list(cache.rglob("*" + TMP_SUFFIX)), "the partial write was not cleared"
    assert _entries(cache) == entries
    stats = _cache_stats(again.url)
    assert stats["disk_entries"] == len(entries) and stats["disk_bad_files"] == 0
    # the first requests after the restart hit on the intact files, with the same tokens
    for name, want in written.replies.items():
        text, cached = _reply(again.url, name)
        assert text == want and cached > 0, (name, text, want, cached)
    assert _reply(again.url, "crane")[0] == crane
    stats = _cache_stats(again.url)
    assert stats["disk_loads"] > 0 and stats["disk_bad_files"] == 0
    log = again.text()
    assert "skipping and deleting" not in log and "Traceback" not in log
    assert again.terminate() == 0, log[-3000:]


# -- a model file truncated on disk --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Damaged:
    sharded: Path  # a safetensors folder whose second shard is cut in half
    shard: Path
    gguf: Path  # a GGUF cut in half


def _shard(source: Path, out: Path) -> Path:
    """`source`'s weights in two shards with an index; the embedding (the bulk) in the
    second. Returns the second shard's path."""
    out.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    weights = load_file(str(source / "model.safetensors"))
    second = {k: v for k, v in weights.items() if "embed" in k}
    parts = {
        "model-00001-of-00002.safetensors": {k: v for k, v in weights.items() if k not in second},
        "model-00002-of-00002.safetensors": second,
    }
    weight_map = {}
    for name, part in parts.items():
        save_file(part, str(out / name))
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out / "model-00002-of-00002.safetensors"


def _cut_in_half(path: Path, out: Path | None = None) -> Path:
    data = path.read_bytes()
    target = out or path
    target.write_bytes(data[: len(data) // 2])
    return target


@pytest.fixture(scope="module")
def damaged(
    tiny_qwen3_dir: Path, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Damaged:
    root = tmp_path_factory.mktemp("damaged")
    shard = _cut_in_half(_shard(tiny_qwen3_dir, root / "sharded"))
    gguf = _cut_in_half(smollm2_gguf, root / "smollm2-cut.gguf")
    return Damaged(root / "sharded", shard, gguf)


def _serve_once(argv: list[str]) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("mlx-gateway")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli.main"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_GATEWAY_")}
    return subprocess.run(
        [*command, "--log-level", "info", *argv, "--port", str(free_port())],
        capture_output=True, text=True, timeout=WAIT_S, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_a_truncated_model_file_is_one_line_from_serve(kind: str, damaged: Damaged) -> None:
    sharded = kind == "safetensors"
    source, file = (damaged.sharded, damaged.shard) if sharded else (damaged.gguf, damaged.gguf)
    done = _serve_once(["serve", "--model", str(source)])
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    [line] = [x for x in done.stderr.splitlines() if x.startswith("mlx-gateway: error:")]
    assert "failed to load" in line and str(file) in line, line
    assert "past the end of the file" in line or "incomplete download" in line, line


def _config(tmp_path: Path, good: Path, damaged: Damaged) -> Path:
    config = tmp_path / "models.toml"
    config.write_text(
        f'[[models]]\nsource = "{good}"\nid = "{MODEL}"\n\n'
        f'[[models]]\nsource = "{damaged.sharded}"\nid = "cut-shard"\n\n'
        f'[[models]]\nsource = "{damaged.gguf}"\nid = "cut-gguf"\n'
    )
    return config


def _openai_stream_error(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    sse = stream(url, path, body)
    assert sse.status == 200 and sse.done, sse.body  # began with keepalives, ended in error
    error: dict[str, Any] = sse.errors[-1]["error"]
    return error


def _responses_stream_error(url: str, body: dict[str, Any]) -> dict[str, Any]:
    from openai.types.responses import ResponseErrorEvent

    with httpx.stream(
        "POST", f"{url}{RESPONSES}", json={**body, "stream": True}, timeout=WAIT_S
    ) as r:
        assert r.status_code == 200
        data = [json.loads(x[5:]) for x in r.iter_lines() if x.startswith("data:")]
    event = ResponseErrorEvent.model_validate(data[-1])
    return {"code": event.code, "message": event.message}


def test_a_truncated_model_among_several_is_an_error_in_each_dialect(
    damaged: Damaged, tiny_qwen3_dir: Path, tmp_path: Path, servers: list[Serve]
) -> None:
    config = _config(tmp_path, tiny_qwen3_dir, damaged)
    server = Serve(["serve", "--config", str(config)], tmp_path / "serve.log")
    servers.append(server.wait_ready())
    url = server.url
    for model, file in (("cut-shard", damaged.shard), ("cut-gguf", damaged.gguf)):
        chat = _chat("hi", 4, model)
        message = {"model": model, "messages": chat["messages"][1:], "max_tokens": 4}
        respond = {"model": model, "input": "hi", "max_output_tokens": 16}
        said = [
            error_of(post(url, CHAT, chat), 500),
            _openai_stream_error(url, CHAT, chat),
            error_of(post(url, RESPONSES, respond), 500),
            _responses_stream_error(url, respond),
        ]
        assert all(e["code"] == "model_load_failed" for e in said), said
        messages = [str(e["message"]) for e in said]
        r = post(url, MESSAGES, message)
        assert r.status_code == 500
        messages.append(check_error(r.json(), "api_error"))
        events = read_events(url, message)
        assert events.status == 200 and events.names[-1] == "error"
        messages.append(check_error(events.named("error")[-1], "api_error"))
        for text in messages:
            assert f"{model!r} failed to load" in text and str(file) in text, text
        # the configured model beside it is untouched, in every dialect
        assert chat_body(post(url, CHAT, _chat("hi", 4))).choices[0].finish_reason
        chat_texts(chat_chunks(stream(url, CHAT, _chat("hi", 4))))
        check_message(post(url, MESSAGES, {**message, "model": MODEL}).json())
        check_stream(read_events(url, {**message, "model": MODEL}))
    health = httpx.get(f"{url}/health", timeout=WAIT_S).json()
    states = {m["id"]: (m["state"], m["last_error"]) for m in health["models"]}
    assert states[MODEL] == ("loaded", None)
    for model in ("cut-shard", "cut-gguf"):
        assert states[model][0] == "unloaded" and "failed to load" in states[model][1]
    assert "Traceback" not in server.text()
    assert server.terminate() == 0


# -- the engine's worker killed, with the disk tier on -------------------------------------


@pytest.fixture
def faulty(tiny_qwen3_dir: Path, tmp_path: Path) -> Iterator[tuple[str, FaultyRunner, Path]]:
    made: list[FaultyRunner] = []
    directory = tmp_path / "cache"

    def load() -> ServedModel:
        served = build_served(tiny_qwen3_dir, model_id=MODEL)
        made.append(FaultyRunner(served, directory))
        engine = Engine(made[0], restart_delay=0.5)
        return dataclasses.replace(served, engine=engine, runner=made[0])

    with live_server(load) as url:
        yield url, made[0], directory


def _health(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/health", timeout=WAIT_S).json()
    return body


def _wait_health(url: str, key: str, value: object) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        body = _health(url)
        if body[key] == value:
            return body
        time.sleep(0.05)
    raise AssertionError(f"/health never showed {key}={value!r}: {_health(url)}")


def test_a_killed_worker_restarts_with_its_prefix_cache_from_disk(
    faulty: tuple[str, FaultyRunner, Path],
) -> None:
    url, runner, directory = faulty
    before = {name: _reply(url, name)[0] for name in ("sea", "rope")}
    with ThreadPoolExecutor(1) as pool:
        doomed = pool.submit(post, url, CHAT, _chat(PROMPTS["dock"], 60_000))
        _wait_health(url, "running", 1)
        runner.fault.set()
        assert error_of(doomed.result(), 503)["code"] == "engine_failed"
    body = _wait_health(url, "state", "ready")
    assert body["engine_restarts"] == 1
    # the fresh worker resets the runner before it takes a request: closing the cache
    # puts what it held on disk, and the first request finds the trie rebuilt from there
    for name, want in before.items():
        text, cached = _reply(url, name)
        assert text == want and cached > 0, (name, text, want, cached)
    stats = _cache_stats(url)
    assert stats["disk_loads"] > 0 and stats["disk_bad_files"] == 0
    assert _entries(directory) and not list(directory.rglob("*" + TMP_SUFFIX))
