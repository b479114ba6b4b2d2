"""Distributed serving end to end: `mlx-gateway serve --distributed` started by
`mlx.launch` as two processes on loopback (ring backend, CPU), against the
single-process server on the same model; and, in this process, the pieces whose
failures would be hard to see there (the control round, evictions decided by rank 0 and
replayed, the engine's halt).

- Greedy chats through rank 0's HTTP server (several at once, plain and streamed, so the
  batch runs; then one continuing an earlier conversation, so the prefix cache hits)
  give the single-process server's messages and token counts, cached tokens included,
  tensor and pipeline parallel.
- Rank 1 frozen (SIGSTOP) mid-generation: the clients get 503s within seconds, rank 0
  stays up and /health says why; a hangup (what a rank 0 started over ssh gets first
  from mlx.launch's teardown) and then the launcher's SIGTERM leave it up. Rank 1 killed
  (SIGKILL) mid-generation: 503s within seconds; mlx.launch then SIGTERMs rank 0 (it
  ends every rank once one fails), which stays up all the same, answering 503s and
  /health that say why, its log moved to a file, until a second SIGTERM ends it.
- A healthy group stopped (SIGTERM to rank 0, or Ctrl-C to the launcher's process
  group) drains and ends, as a single server does.

The tiny random model has 2 layers and 4 heads over 2 KV heads, so it splits over two
ranks either way. Bounds on time are generous (a shared 2-core machine): the group's
timeout is 3 s, the assertions allow far more.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from gateway.core.models.build import build_served
from gateway.core.settings import EngineSettings
from runtime.distributed.channel import Channel, Command, GroupLost, Round
from runtime.distributed.replica import GroupMemory, LockstepPrefixCache
from runtime.engine import (
    Engine,
    EngineFailure,
    EngineState,
    EngineUnavailable,
    RequestHandle,
)
from runtime.types import Finished, FinishReason, GenerationRequest, TextDelta
from tests.support.live_server import free_port, live_server, pid_alive
from tests.support.openai_checks import (
    chat_body,
    chat_chunks,
    error_of,
    open_after,
    post,
    stream,
)
from tests.support.recurrent_model import FULL, RECURRENT, SLIDING, HybridModel

MODEL = "tiny-split"
CHAT = "/v1/chat/completions"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
REPO = Path(__file__).resolve().parents[2]
START_S = 240.0  # a group's start: two processes import, load and build on 2 busy cores
EXIT_S = 90.0  # a stopped rank 0 to the launcher's exit
LINGER_S = 30.0  # the launcher's SIGTERM to a broken group's rank 0 saying it stays up
LONG = 20_000  # tokens: far beyond any wait here
SETTINGS = EngineSettings(max_batch=4)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


def _build(tokenizer_dir: Path, out: Path) -> Path:
    """A random Qwen3 folder that splits over two ranks: heads, KV heads and layers even."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = [int(v) for v in tok["model"]["vocab"].values()]
    vocab = max(ids + [int(t["id"]) for t in tok.get("added_tokens", ())]) + 1
    rng = np.random.default_rng(7)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    weights = {"model.embed_tokens.weight": w(vocab, HIDDEN), "model.norm.weight": ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": ones(HIDDEN),
            p + "post_attention_layernorm.weight": ones(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": ones(HEAD_DIM),
            p + "self_attn.k_norm.weight": ones(HEAD_DIM),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
        }
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": vocab,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": 151645,
        "bos_token_id": 151643,
    }
    (out / "config.json").write_text(json.dumps(config))
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def split_model(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(qwen3_tokenizer_dir, tmp_path_factory.mktemp("tiny-split"))


# -- a group under mlx.launch ----------------------------------------------------------


@dataclass
class Group:
    url: str
    process: subprocess.Popen[bytes]
    log: Path  # where rank 0 logs once it stays up after the group was lost
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def pid(self, rank: int) -> int:
        found = re.search(rf"rank {rank} of 2 .*\(pid (\d+)\)", self.output)
        assert found, f"rank {rank} never said its pid:\n{self.output}"
        return int(found.group(1))

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=30)

    def wait_exit(self) -> int:
        try:
            return self.process.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the group did not end:\n{self.output}") from None

    def said(self, text: str) -> None:
        """Wait for `text` in the launcher's output (within LINGER_S): the thread reading
        its pipe may not have reached a line the launcher has already written."""
        deadline = time.monotonic() + LINGER_S
        while text not in self.output:
            if time.monotonic() > deadline:
                raise AssertionError(f"the launcher never said {text!r}:\n{self.output}")
            time.sleep(0.1)

    def logged(self, text: str) -> str:
        """Rank 0's log file once it holds `text` (within LINGER_S)."""
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            found = self.log.read_text() if self.log.exists() else ""
            if text in found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"rank 0 never logged {text!r} to {self.log}:\n{self.output}")


def _ring_ports() -> int:
    """A first port whose successor is free too (rank r listens on first + r)."""
    for _ in range(50):
        first = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", first + 1))
            except OSError:
                continue
        return first
    raise RuntimeError("no two consecutive free ports")


@contextmanager
def launched(model: Path, mode: str, home: Path, *extra: str) -> Iterator[Group]:
    """Two ranks under mlx.launch serving `model` (MLX_GATEWAY_HOME `home`, more serve
    options `extra`); every process is killed at the end."""
    port = free_port()
    command = [
        str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(_ring_ports()),
        "--python", sys.executable, "--",
        "-m", "gateway", "serve", "--model", str(model), "--model-id", MODEL,
        "--distributed", mode, "--distributed-timeout", "3", "--port", str(port),
        "--max-batch", str(SETTINGS.max_batch), *extra,
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "MLX_GATEWAY_HOME": str(home)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the ranks share the launcher's process group
    )
    log = home / "logs" / f"distributed-rank0-{port}.log"
    group = Group(f"http://127.0.0.1:{port}", process, log)

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            group.lines.append(line.decode(errors="replace").rstrip())

    threading.Thread(target=read, daemon=True).start()
    try:
        _wait_ready(group)
        yield group
    finally:
        with suppress(ProcessLookupError):  # a lingering rank 0 included
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def _wait_ready(group: Group) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if group.process.poll() is not None:
            raise AssertionError(f"the group ended at start:\n{group.output}")
        try:
            if group.health().status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the group did not start within {START_S:g} s:\n{group.output}")


# -- the same chats on both servers ------------------------------------------------------

QUESTIONS = ["Name three colours.", "What is two plus two?", "Say hi in French."]


def _body(messages: list[dict[str, Any]], max_tokens: int = 12) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _summary(body: Any, *, cached: bool = True) -> dict[str, Any]:
    """What must match; the cached tokens only where no timing decides them (a chat that
    arrives with others reuses what those recorded before it, if they came first)."""
    choice = body.choices[0]
    usage = body.usage
    out = {
        "message": choice.message.model_dump(exclude_none=True),
        "finish": choice.finish_reason,
        "prompt": usage.prompt_tokens,
        "completion": usage.completion_tokens,
    }
    if cached:
        out["cached"] = usage.prompt_tokens_details.cached_tokens
    return out


def _chats(url: str) -> list[dict[str, Any]]:
    """Three plain chats and a streamed one at once, then the first conversation goes on
    (its prompt extends an earlier one: the prefix cache hits)."""
    with ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(post, url, CHAT, _body(_user(q))) for q in QUESTIONS]
        streamed = pool.submit(stream, url, CHAT, _body(_user("Count to five.")))
        answers = [chat_body(f.result()) for f in plain]
        chunks = chat_chunks(streamed.result())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    first = answers[0].choices[0].message
    history = [*_user(QUESTIONS[0]), {"role": "assistant", "content": first.content or ""}]
    again = chat_body(post(url, CHAT, _body([*history, *_user("Three more?")])))
    out = [_summary(a, cached=False) for a in answers]
    return [*out, {"streamed": text}, _summary(again)]


@pytest.fixture(scope="module")
def single(split_model: Path) -> list[dict[str, Any]]:
    """The single-process server's answers."""
    with live_server(lambda: build_served(split_model, model_id=MODEL, settings=SETTINGS)) as url:
        return _chats(url)


# -- losing a rank ----------------------------------------------------------------------


def _running(group: Group, count: int) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if group.health().json().get("running", 0) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"{count} generations never ran:\n{group.output}")


def _lose_rank_1(group: Group, sig: signal.Signals) -> str:
    """Two long generations (plain and streamed), then rank 1 gets `sig`: both end with
    503s (not the clients' own timeouts); the error's message."""
    body = _body(_user("Tell me a long story."), LONG)
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(post, group.url, CHAT, body)
        streamed = pool.submit(stream, group.url, CHAT, body)
        _running(group, 2)
        os.kill(group.pid(1), sig)
        err = error_of(plain.result(), 503)
        sse = streamed.result()
    assert err["code"] == "engine_failed" and err["type"] == "overloaded_error"
    assert sse.status == 200 and sse.done and sse.errors[-1]["error"]["code"] == "engine_failed"
    return str(err["message"])


def _failed_for_good(group: Group, what: str) -> None:
    """Rank 0 refuses work and says why (`what`, and how to mend it) on /health and in a
    chat's 503; /v1/models still answers."""
    health = group.health()
    assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1
    body = health.json()
    assert body["state"] == "engine_failed" and body["live"] and not body["ready"]
    assert what in body["last_engine_failure"]
    assert "restart the group with mlx.launch" in body["last_engine_failure"]
    refused = error_of(post(group.url, CHAT, _body(_user("hi"))), 503)
    assert refused["code"] == "engine_failed"
    assert what in refused["message"] and "restart the group with mlx.launch" in refused["message"]
    models = httpx.get(f"{group.url}/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def _stop_lingering(group: Group, rank_0: int) -> None:
    """A SIGTERM after the launcher's ends the lingering rank 0, status 1 (wait_exit
    guards a hang); the launcher then ends, passing on the line rank 0 wrote before its
    log moved."""
    os.kill(rank_0, signal.SIGTERM)
    group.wait_exit()
    assert not pid_alive(rank_0)
    group.said("Node with rank 0 exited with code 1")
    group.said(f"its log is now {group.log}")
    assert "SIGTERM: leaving (the distributed group was lost" in group.log.read_text()


def test_tensor_parallel_serves_as_one_process_and_a_frozen_rank_gives_503s(
    split_model: Path, single: list[dict[str, Any]], tmp_path: Path
) -> None:
    with launched(split_model, "tensor", tmp_path) as group:
        got = _chats(group.url)
        assert got == single
        assert got[-1]["cached"] > 0  # the continued conversation reused its prefix

        why = _lose_rank_1(group, signal.SIGSTOP)
        assert "rank 1 did not answer" in why
        # rank 0 stays up, refusing work and saying why (and again after each signal below)
        _failed_for_good(group, "rank 1 did not answer")

        # mlx.launch's teardown as a rank 0 started over ssh sees it: its session's
        # hangup, then the launcher's SIGTERM (once rank 1 exits); neither ends it
        rank_0 = group.pid(0)
        os.kill(rank_0, signal.SIGHUP)
        group.logged("SIGHUP after the distributed group was lost")
        os.kill(group.pid(1), signal.SIGKILL)
        group.logged("SIGTERM: staying up")
        assert pid_alive(rank_0) and group.process.poll() is None
        _failed_for_good(group, "rank 1 did not answer")
        _stop_lingering(group, rank_0)


def test_pipeline_parallel_serves_as_one_process_and_a_killed_rank_gives_503s(
    split_model: Path, single: list[dict[str, Any]], tmp_path: Path
) -> None:
    with launched(split_model, "pipeline", tmp_path) as group:
        got = _chats(group.url)
        assert got == single

        rank_0 = group.pid(0)
        why = _lose_rank_1(group, signal.SIGKILL)
        assert "rank 1" in why and "restart the group with mlx.launch" in why
        # mlx.launch SIGTERMs rank 0 once rank 1 exited; rank 0 stays up, its log moved
        # off the launcher's pipe (which the launcher no longer reads: it waits for it)
        log = group.logged("SIGTERM after the distributed group was lost")
        assert "rank 1" in log and "restart the group with mlx.launch" in log
        group.said("Node with rank 1 exited")
        # the log line is rank 0's handler deciding to stay; /health below answers from it
        assert pid_alive(rank_0) and group.process.poll() is None
        _failed_for_good(group, "rank 1")
        _stop_lingering(group, rank_0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_healthy_group_stopped_drains_and_ends(
    split_model: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """As a single server: the running generation finishes, then every rank leaves.
    SIGTERM to rank 0 (a `kill`); SIGINT to every rank (a terminal's Ctrl-C reaches them
    all; not the launcher here, whose own Ctrl-C handling can deadlock its threads)."""
    # a grace no loaded machine runs out of: the drain, not its deadline, ends the stream
    with launched(split_model, "tensor", tmp_path, "--shutdown-grace", "600") as group:
        pids = group.pid(0), group.pid(1)
        with ThreadPoolExecutor(1) as pool:
            # the signal goes once the client has read a token: the generation is then
            # decoding (polling /health could miss a short one), with most of it to go
            decoding = threading.Event()
            running = pool.submit(
                stream, group.url, CHAT, _body(_user("A story."), 200),
                on_line=open_after(decoding, 2, prefix="data:"),
            )  # fmt: skip
            assert decoding.wait(START_S), f"the generation never started:\n{group.output}"
            for pid in pids if sig == signal.SIGINT else pids[:1]:
                os.kill(pid, sig)
            sse = running.result()
        assert sse.status == 200 and sse.done and not sse.errors
        assert chat_chunks(sse)[-1].choices[0].finish_reason in ("length", "stop")
        group.wait_exit()
        assert not any(pid_alive(pid) for pid in pids)
        assert not group.log.exists()  # it never stayed up
        group.said(f"{sig.name}: draining")
        assert "exited with code" not in group.output, group.output  # every rank: 0


# -- the pieces, in this process --------------------------------------------------------


def test_a_round_carries_rank_0s_decisions() -> None:
    """Over a group of one, a round comes back as sent: the JSON, the timings to the bit,
    the batch's bytes, the step's bound and memory; the rank's slot says it heard every
    round, and what cache memory it holds (to the KiB)."""
    channel = Channel(mx.distributed.init(strict=False))
    payload = {"admit": [{"serial": 1, "prompt": list(range(3000))}], "cancel": [4]}
    sent = Round(
        Command.STEP, payload, (0.123456789, 1234.5678), (2**40 + 3, 7), 2.5, 3 * 2**40 + 1
    )
    first = channel.send(sent, digest=99, held=5 * 2**30 + 1500)
    second = channel.send(Round(Command.IDLE), digest=5)
    assert first.round == sent
    assert (first.number, first.seen, first.digests, first.present) == (1, (0,), (99,), (True,))
    assert first.held == (5 * 2**30 + 1024,)
    assert second.round == Round(Command.IDLE) and second.seen == (1,) and second.held == (0,)


def test_a_round_without_a_ranks_part_is_a_lost_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective that fails on a broken link can come back with only this rank's part
    (MLX's ring backend fails its pending sums): a rank's empty slot ends the group, and
    the round does not count as heard (rank 0 deciding on a SIGTERM takes two rounds heard
    for a healthy group)."""
    channel = Channel(mx.distributed.init(strict=False))
    channel.size = 2  # rank 1's part of every sum lost: the sum is rank 0's own
    monkeypatch.setattr(channel, "_all_sum", lambda values: values.copy())
    with pytest.raises(GroupLost, match="rank 1 left the group"):
        channel.send(Round(Command.IDLE), digest=5)
    assert channel.rounds == 0


def test_rank_0_works_to_the_budget_of_the_rank_holding_most() -> None:
    """Rank 0 decides by its own cache bytes; when another rank holds more of the same
    tokens (a full-attention stage against rank 0's sliding windows), the budget it works
    to shrinks by that ratio, and grows back when the shares even out."""
    memory = GroupMemory(1000 * 2**20)
    assert memory.update(()) == 1000 * 2**20  # the first round: nothing heard yet
    assert memory.update((100 * 2**20, 400 * 2**20, 50 * 2**20)) == 250 * 2**20
    assert memory.update((2**10, 2**20)) == 250 * 2**20  # too little held to say: unchanged
    assert memory.update((200 * 2**20, 100 * 2**20)) == 1000 * 2**20  # rank 0 the largest


def _serve_one(pc: LockstepPrefixCache[Any], model: HybridModel, prompt: list[int]) -> None:
    """One request through a prefix cache, as the scheduler drives it (no budget check:
    between steps a lockstep cache may be over it)."""
    lease = pc.begin(prompt)
    pos, last = lease.reused, len(prompt) - 1
    for target in sorted({*lease.snapshot_points, last}):
        if target > pos:
            model.forward(mx.array(prompt[pos:target], dtype=mx.int32)[None], lease.caches)
            pos = target
        if target in lease.snapshot_points:
            pc.snapshot_at(lease, target)
    tokens = list(prompt)
    for _ in range(3):
        hidden = model.forward(mx.array(tokens[-1:], dtype=mx.int32)[None], lease.caches)
        logits = np.array(model.logits(hidden[:, -1]))
        tokens.append(int(logits.argmax()))
    pc.end(lease, tokens[: lease.caches[0].offset])


def test_evictions_are_rank_0s_and_every_rank_evicts_the_same() -> None:
    """Rank 0 evicts between steps against its own limit; a follower whose own limit is
    far lower never evicts by itself, and replaying rank 0's victims leaves its trie
    the same as rank 0's."""
    model = HybridModel((FULL, RECURRENT, SLIDING), window=6, seed=3)

    def cache(budget: int) -> LockstepPrefixCache[Any]:
        return LockstepPrefixCache(model.make_caches, budget_bytes=budget, snapshot_interval=4)

    leader, follower = cache(3000), cache(1)
    system = [1, 2, 3, 4, 5, 6, 7]
    victims = 0
    for i in range(6):
        prompt = [*system, 100 + i, 101 + i, 102, 103 + i]
        for pc in (leader, follower):
            _serve_one(pc, model, prompt)
        assert follower.stats()["evictions"] == leader.stats()["evictions"]  # none yet
        chosen = leader.decide_evictions()
        follower.replay_evictions(chosen)
        victims += len(chosen)
        assert follower.dump() == leader.dump()
        assert leader.stats()["paged_bytes"] <= 3000
    assert victims > 0 and follower.stats()["evictions"] == leader.stats()["evictions"]


class StuckRunner:
    """A batch runner whose step blocks like a collective whose peer is gone."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.stepping = threading.Event()
        self.aborted = threading.Event()  # the abandoned worker reset the runner
        self.rows: list[RequestHandle] = []

    @property
    def idle(self) -> bool:
        return not self.rows

    def has_room(self) -> bool:
        return True

    def admit(self, handle: RequestHandle) -> None:
        self.rows.append(handle)

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        handle = self.rows[0]
        handle.emit(TextDelta("x", (1,)))
        self.stepping.set()
        self.release.wait(30)
        return []

    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]:
        rows, self.rows = self.rows, []
        self.aborted.set()
        return [(h, Finished(reason, _stats(h), error)) for h in rows]

    def load(self) -> tuple[int, int, int, float]:
        return len(self.rows), 0, 0, 0.0


def _stats(handle: RequestHandle) -> Any:
    from runtime.types import GenerationStats

    return GenerationStats(len(handle.request.prompt_tokens), handle.tokens_out)


def test_a_halted_engine_fails_its_requests_and_refuses_new_ones_for_good() -> None:
    runner = StuckRunner()
    engine = Engine(runner, restart_delay=0.05)
    engine.start()
    engine.watch()
    try:
        handle = engine.submit(GenerationRequest((1, 2), 5))
        assert runner.stepping.wait(30)
        engine.halt("rank 1 did not answer")  # from another thread, the step still stuck
        done = [e for e in handle][-1]
        assert isinstance(done, EngineFailure) and "rank 1 did not answer" in (done.error or "")
        with pytest.raises(EngineUnavailable, match="rank 1 did not answer") as refused:
            engine.submit(GenerationRequest((3,), 1))
        assert refused.value.state is EngineState.FAILED
        runner.release.set()  # the stuck step returns: still no fresh worker
        assert runner.aborted.wait(30)  # the abandoned worker reset the batch and left
        health = engine.health()
        assert health.state is EngineState.FAILED and health.restarts == 0
        assert health.last_failure == "rank 1 did not answer"
    finally:
        runner.release.set()
        engine.stop()


class DecidingRunner:
    """What rank 0's SIGTERM decision reads of its runner: rounds counted, the watchdog's
    deadline for the round in flight, and why the group was lost. Each read of the
    deadline is one poll of the decision; `lose_at` / `round_every` act on those polls."""

    def __init__(self, watched: float | None, lose_at: int = 0, round_every: int = 0) -> None:
        self.channel = type("Counted", (), {"rounds": 0})()
        self.timeout = 600.0
        self.lost: str | None = None
        self._watched, self._lose_at, self._round_every = watched, lose_at, round_every
        self.polls = 0

    @property
    def watched_until(self) -> float | None:
        self.polls += 1
        if self._lose_at and self.polls >= self._lose_at:
            self.lost = "rank 1 did not answer within 3 s (a step)"
        if self._round_every and self.polls % self._round_every == 0:
            self.channel.rounds += 1
        return self._watched


def _decide(runner: DecidingRunner, seconds: float) -> str | None:
    from types import SimpleNamespace

    from gateway.cli.serve.distributed_stop import GroupServer

    server = SimpleNamespace(runner=runner)
    return asyncio.run(GroupServer._lost_within(server, seconds))  # type: ignore[arg-type]


def test_a_sigterm_decision_waits_for_the_watchdog_of_the_round_in_flight() -> None:
    """The fixed wait is over at once, but a round is in flight whose watchdog has not
    spoken yet: a rank that died silently is known only then, so the decision waits
    for it (before, it drained and clients lost the server that says why)."""
    runner = DecidingRunner(time.monotonic() + 600, lose_at=3)
    assert _decide(runner, 0.0) == "rank 1 did not answer within 3 s (a step)"
    assert runner.polls == 3


def test_a_sigterm_decision_ends_when_the_watchdog_passed_or_two_rounds_complete() -> None:
    # the round's watchdog deadline (and its slack) already passed, nothing lost: healthy
    assert _decide(DecidingRunner(time.monotonic() - 1.0), 0.0) is None
    # a far deadline, but every rank answered two rounds after the signal: healthy
    runner = DecidingRunner(time.monotonic() + 600, round_every=2)
    assert _decide(runner, 0.0) is None and runner.channel.rounds == 2
    # a round bounded by minutes (a prefill's): the wait stops at the group's timeout
    runner = DecidingRunner(time.monotonic() + 600)
    runner.timeout = 0.0
    assert _decide(runner, 0.0) is None and runner.lost is None
