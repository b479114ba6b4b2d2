"""Several models behind one server (gateway/core/models/registry.py): listed loaded or
not, each request routed to the model it names, loaded on demand on a thread of its own
(streams get keepalives meanwhile), unloaded after --keep-alive idle seconds and least
recently used first when the memory budget fits only one; unknown names are 404s in each
dialect's shape. Two tiny random Qwen3s (different seeds: different greedy text) stand in
for real models; the OpenAI and Anthropic SDK types check every body."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
from openai.types import Model  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gateway.cli.args import build_parser  # noqa: E402
from gateway.cli.errors import CliError  # noqa: E402
from gateway.cli.serve.command import model_registry  # noqa: E402
from gateway.cli.serve.models import ModelConfig, from_flags, read_config  # noqa: E402
from gateway.core.models.build import build_served  # noqa: E402
from gateway.core.models.memory import (  # noqa: E402
    MIN_CACHE_BYTES,
    cache_budget,
    physical_memory,
    served_bytes,
    weight_file_bytes,
)
from gateway.core.models.registry import ModelRegistry  # noqa: E402
from gateway.core.models.served import ServedModel  # noqa: E402
from gateway.core.models.spec import ModelSpec  # noqa: E402
from gateway.core.models.status import ModelState  # noqa: E402
from gateway.core.settings import EngineSettings, ServerSettings  # noqa: E402
from runtime.engine import Engine, RequestHandle  # noqa: E402
from runtime.types import Finished, FinishReason, GenerationStats, TextDelta  # noqa: E402
from tests.support.agent_model import build_tiny_qwen3  # noqa: E402
from tests.support.anthropic_checks import (  # noqa: E402
    Events,
    check_error,
    check_message,
    check_stream,
    read_events,
)
from tests.support.live_server import live_server  # noqa: E402
from tests.support.openai_checks import (  # noqa: E402
    chat_body,
    chat_chunks,
    error_of,
    open_after,
    post,
    stream,
)

A, B = "tiny-a", "tiny-b"
CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
HELLO = [{"role": "user", "content": "Name three colors."}]
FAST = ServerSettings(keepalive_seconds=0.1)  # a load held on its gate soon sees keepalives
WAIT_S = 60.0
# each model's cache memory (batch and prefix trie): small beside its weights, so the
# budgets below are set by the weights as the tests intend
CACHE_BYTES = 1024**2


@pytest.fixture(scope="module")
def folders(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("two-models")
    return {
        A: build_tiny_qwen3(qwen3_tokenizer_dir, root / A, seed=1),
        B: build_tiny_qwen3(qwen3_tokenizer_dir, root / B, seed=2),
    }


class HeldRunner:
    """Stands in for a model's generation: writes nothing until `gate` is set, then one
    piece per token (a stream that stays open exactly as long as the test wants)."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def run(self, handle: RequestHandle) -> Finished:
        prompt = len(handle.request.prompt_tokens)
        assert self.gate.wait(WAIT_S)
        for n in range(handle.request.max_tokens):
            if handle.cancelled:
                return Finished(FinishReason.CANCELLED, GenerationStats(prompt, n))
            handle.emit(TextDelta(f"t{n} ", (n,)))
        return Finished(FinishReason.LENGTH, GenerationStats(prompt, handle.request.max_tokens))


class Loads:
    """Counts each model's loads; a model listed in `gates` waits for its event before
    it loads, and one in `held` generates with a HeldRunner on that event."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.gates: dict[str, threading.Event] = {}
        self.held: dict[str, threading.Event] = {}
        self.fail: set[str] = set()

    def spec(self, folder: Path, model_id: str, aliases: frozenset[str] = frozenset()) -> ModelSpec:
        def build() -> ServedModel:
            self.count[model_id] = self.count.get(model_id, 0) + 1
            if model_id in self.gates:
                assert self.gates[model_id].wait(WAIT_S)
            if model_id in self.fail:
                raise RuntimeError("the weights are unreadable")
            settings = EngineSettings(cache_memory_bytes=CACHE_BYTES)
            served = build_served(folder, model_id=model_id, aliases=aliases, settings=settings)
            if model_id in self.held:
                engine = Engine(HeldRunner(self.held[model_id]))
                return dataclasses.replace(served, engine=engine, runner=None)
            return served

        return ModelSpec(
            model_id,
            build,
            aliases,
            str(folder),
            weight_bytes=weight_file_bytes(folder),
            cache_bytes=CACHE_BYTES,
        )


def _registry(folders: dict[str, Path], loads: Loads, **kw: Any) -> ModelRegistry:
    specs = [loads.spec(folders[A], A, frozenset({"a-alias"})), loads.spec(folders[B], B)]
    return ModelRegistry(specs, **kw)


@pytest.fixture(scope="module")
def pair(folders: dict[str, Path]) -> Iterator[tuple[str, Loads]]:
    """A and B, never unloaded, room for both."""
    loads = Loads()
    with live_server(_registry(folders, loads, keep_alive=0, memory_budget=1 << 40)) as url:
        yield url, loads


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": HELLO, "max_tokens": 8, "temperature": 0, **extra}


def _message(model: str) -> dict[str, Any]:
    return {"model": model, "messages": HELLO, "max_tokens": 8}


def _states(url: str) -> dict[str, str]:
    health = httpx.get(f"{url}/health", timeout=WAIT_S).json()
    return {m["id"]: m["state"] for m in health["models"]}


def _wait_states(url: str, want: dict[str, str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        states = _states(url)
        if all(states[k] == v for k, v in want.items()):
            return
        time.sleep(0.05)
    raise AssertionError(f"/health never showed {want}: {_states(url)}")


def _engine_counts(url: str, name: str) -> dict[str, float]:
    """A labelled engine series from /metrics: model -> value."""
    text = httpx.get(f"{url}/metrics", timeout=WAIT_S).text
    return {
        s.labels["model"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


# -- listing and routing ---------------------------------------------------------------------


def test_every_model_is_listed_loaded_or_not(pair: tuple[str, Loads]) -> None:
    url, loads = pair
    cards = httpx.get(f"{url}/v1/models", timeout=WAIT_S).json()["data"]
    assert [c["id"] for c in cards[:3]] == [A, "a-alias", B]
    for card in cards:
        Model.model_validate(card)
    first = {c["id"]: c for c in cards}
    assert first[A]["loaded"] and first[A]["state"] == "loaded"
    assert first["a-alias"]["alias_of"] == A and first[A]["context_length"] > 0
    if loads.count.get(B, 0) == 0:  # no other test has asked for it yet
        assert not first[B]["loaded"] and first[B]["state"] == "unloaded"
        assert first[B]["source"] and "context_length" not in first[B]
    listed = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).models.list()
    assert {m.id for m in listed} >= {A, "a-alias", B}
    health = httpx.get(f"{url}/health", timeout=WAIT_S).json()
    assert health["model"] == A and health["model_loaded"] and health["state"] == "ready"
    assert {m["id"] for m in health["models"]} == {A, B}


def test_each_request_goes_to_the_model_it_names(pair: tuple[str, Loads]) -> None:
    url, loads = pair
    before = _engine_counts(url, "mlx_gateway_generations_total")
    first = chat_body(post(url, CHAT, _chat(A)))
    second = chat_body(post(url, CHAT, _chat(B)))  # loads B on demand
    assert (first.model, second.model) == (A, B)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == second.usage.prompt_tokens  # one tokenizer
    # different weights, same greedy prompt: different text, each reproducible
    assert first.choices[0].message.content != second.choices[0].message.content
    again = chat_body(post(url, CHAT, _chat("a-alias")))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert loads.count[B] == 1 and _states(url) == {A: "loaded", B: "loaded"}
    # each engine counted its own generations
    after = _engine_counts(url, "mlx_gateway_generations_total")
    assert after[A] - before.get(A, 0) == 2 and after[B] - before.get(B, 0) == 1


def test_anthropic_and_responses_route_too(pair: tuple[str, Loads]) -> None:
    url, _ = pair
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=WAIT_S)
    for name in (A, B):
        msg = client.messages.create(**_message(name))
        assert msg.model == name and msg.usage.output_tokens > 0
        body = httpx.post(f"{url}{MESSAGES}", json=_message(name), timeout=WAIT_S).json()
        assert check_message(body).model == name
        count = httpx.post(f"{url}{MESSAGES}/count_tokens", json=_message(name), timeout=WAIT_S)
        usage = msg.usage
        assert count.json()["input_tokens"] == usage.input_tokens + (
            usage.cache_read_input_tokens or 0
        )
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    reply = oai.responses.create(model=B, input="Name three colors.", max_output_tokens=8)
    assert reply.model == B and reply.usage is not None and reply.usage.output_tokens > 0
    tokens = httpx.post(f"{url}/tokenize", json={"model": B, "prompt": "hi"}, timeout=WAIT_S)
    assert tokens.status_code == 200 and tokens.json()["count"] > 0


def test_an_unknown_model_is_a_404_in_each_dialect(pair: tuple[str, Loads]) -> None:
    url, _ = pair
    err = error_of(post(url, CHAT, _chat("gpt-5")), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    for name in (A, "a-alias", B):
        assert repr(name) in err["message"]
    streamed = stream(url, CHAT, _chat("gpt-5"))
    assert streamed.status == 404 and "model_not_found" in streamed.body
    r = post(url, MESSAGES, _message("claude-opus-4-1"))
    assert r.status_code == 404
    message = check_error(r.json(), "not_found_error")
    assert repr(A) in message and repr(B) in message
    assert error_of(httpx.get(f"{url}/v1/models/gpt-5"), 404)["code"] == "model_not_found"
    assert error_of(post(url, "/v1/responses", {"model": "x", "input": "hi"}), 404)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model="gpt-5",
            messages=HELLO,
        )
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
            **_message("claude-opus-4-1")
        )


# -- loading on demand ---------------------------------------------------------------------


def test_a_stream_to_an_unloaded_model_gets_keepalives(folders: dict[str, Path]) -> None:
    """B loads once the client has read three keepalive comments."""
    loads = Loads()
    loaded = loads.gates[B] = threading.Event()
    with live_server(_registry(folders, loads, keep_alive=0), FAST) as url:
        body = _chat(B, stream_options={"include_usage": True})
        sse = stream(url, CHAT, body, on_line=open_after(loaded, 3))
        chunks = chat_chunks(sse)
        assert sse.comments_before_data >= 3, sse.comments  # sent while B loaded
        assert {c.model for c in chunks} == {B} and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens > 0
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        events = list(oai.responses.create(model=B, input="hi", max_output_tokens=4, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.model == B


def test_an_anthropic_stream_to_an_unloaded_model_pings_first(folders: dict[str, Path]) -> None:
    """B loads once the client has read three pings."""
    loads = Loads()
    loaded = loads.gates[B] = threading.Event()
    with live_server(_registry(folders, loads, keep_alive=0), FAST) as url:
        events = read_events(url, _message(B), on_line=open_after(loaded, 3, "event: ping"))
        start = events.names.index("message_start")
        assert start >= 3 and set(events.names[:start]) == {"ping"}, events.names[:start]
        msg = check_stream(Events(events.status, events.items[start:]))
        assert msg.model == B
        # through the SDK, which skips the pings
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=WAIT_S)
        with client.messages.stream(**_message(B)) as s:
            assert s.get_final_message().model == B


def test_loading_one_model_never_stalls_another(folders: dict[str, Path]) -> None:
    loads = Loads()
    gate = loads.gates[B] = threading.Event()
    with live_server(_registry(folders, loads, keep_alive=0), FAST) as url:
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(post, url, CHAT, _chat(B))
            plain = pool.submit(stream, url, CHAT, _chat(B))
            _wait_states(url, {B: "loading"})
            for _ in range(3):  # A answers while B's load is stuck
                assert chat_body(post(url, CHAT, _chat(A))).model == A
            assert not waiting.done() and not plain.done()
            gate.set()
            assert chat_body(waiting.result(WAIT_S)).model == B
            assert {c.model for c in chat_chunks(plain.result(WAIT_S))} == {B}
        assert loads.count[B] == 1  # both waiters shared one load


def test_a_model_generates_undisturbed_while_another_loads(folders: dict[str, Path]) -> None:
    """A's engine thread decodes while B's weights load on another thread (MLX on two
    threads at once): A's greedy text is the same as when it ran alone."""
    loads = Loads()
    with live_server(_registry(folders, loads, keep_alive=0), FAST) as url:
        body = _chat(A, max_tokens=300)
        alone = chat_body(post(url, CHAT, body)).choices[0].message.content
        with ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                loading = pool.submit(post, url, CHAT, _chat(B))
                rest = [line[5:].strip() for line in lines if line.startswith("data:")]
            assert chat_body(loading.result(WAIT_S)).model == B
        chunks = [json.loads(d) for d in rest if d != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == alone and loads.count[B] == 1


def test_a_failed_load_is_an_error_in_each_dialect_and_is_retried(
    folders: dict[str, Path],
) -> None:
    loads = Loads()
    loads.fail.add(B)
    with live_server(_registry(folders, loads, keep_alive=0), FAST) as url:
        err = error_of(post(url, CHAT, _chat(B)), 500)
        assert err["code"] == "model_load_failed" and "unreadable" in err["message"]
        sse = stream(url, CHAT, _chat(B))
        assert sse.status == 200 and sse.done  # the stream began before the load failed
        assert sse.errors[-1]["error"]["code"] == "model_load_failed"
        events = read_events(url, _message(B))
        assert events.names[-1] == "error"
        assert "unreadable" in check_error(events.named("error")[-1], "api_error")
        health = httpx.get(f"{url}/health", timeout=WAIT_S).json()
        entry = next(m for m in health["models"] if m["id"] == B)
        assert entry["state"] == "unloaded" and "unreadable" in entry["last_error"]
        loads.fail.clear()
        assert chat_body(post(url, CHAT, _chat(B))).model == B
        assert loads.count[B] == 4


# -- unloading -----------------------------------------------------------------------------


def test_keep_alive_unloads_idle_models_and_the_next_request_reloads(
    folders: dict[str, Path],
) -> None:
    loads = Loads()
    with live_server(_registry(folders, loads, keep_alive=0.3), FAST) as url:
        first = chat_body(post(url, CHAT, _chat(B)))
        _wait_states(url, {A: "unloaded", B: "unloaded"})
        health = httpx.get(f"{url}/health", timeout=WAIT_S)
        body = health.json()  # the default is unloaded, the server is still ready
        assert health.status_code == 200 and body["state"] == "ready"
        assert not body["model_loaded"] and body["context_length"] > 0
        again = chat_body(post(url, CHAT, _chat(B)))
        assert again.choices[0].message.content == first.choices[0].message.content
        assert loads.count[B] == 2
        # counters outlive the engines that counted them
        _wait_states(url, {B: "unloaded"})
        assert _engine_counts(url, "mlx_gateway_generations_total")[B] == 2
        card = httpx.get(f"{url}/v1/models/{B}", timeout=WAIT_S).json()
        assert card["state"] == "unloaded" and card["context_length"] > 0  # its last load's


def test_a_model_in_use_is_not_unloaded(folders: dict[str, Path]) -> None:
    loads = Loads()
    gate = loads.held[A] = threading.Event()  # A's stream writes once the test says
    registry = _registry(folders, loads, keep_alive=0.05)
    with live_server(registry, FAST) as url:
        body = {**_chat(A), "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=WAIT_S) as r:
            assert r.status_code == 200  # the stream began: it holds A's lease
            _wait_states(url, {A: "loaded"})  # (it may have reloaded A, idle since start)
            unloads = registry.status()[0].unloads
            # B, used after A's lease began, goes idle and is unloaded: A's keep-alive
            # has passed too, while its stream ran
            assert chat_body(post(url, CHAT, _chat(B))).model == B
            _wait_states(url, {B: "unloaded"})
            assert _states(url)[A] == "loaded" and registry.status()[0].unloads == unloads
            gate.set()
            rest = [line for line in r.iter_lines() if line.startswith("data:")]
        # ran to its end (its keep-alive starts only now)
        assert rest[-1] == "data: [DONE]" and len(rest) > 100
        assert not any('"error"' in line for line in rest)


def test_a_lease_holds_its_model_and_its_release_starts_the_keep_alive(
    folders: dict[str, Path],
) -> None:
    loads = Loads()
    registry = _registry(folders, loads, keep_alive=0.1)
    asyncio.run(registry.open())

    def wait_unloaded(index: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while registry.status()[index].state is not ModelState.UNLOADED:
            assert time.monotonic() < deadline, "never unloaded"
            time.sleep(0.02)

    try:
        lease = registry.lease(registry.default)
        # B, loaded after the lease began, goes idle and is unloaded: the default's
        # keep-alive has passed too, and the lease kept it
        registry.load(registry.find(B)).result(WAIT_S)
        wait_unloaded(1)
        assert registry.loaded(registry.default) is not None
        lease.release()
        lease.release()  # twice is once
        wait_unloaded(0)
        assert [s.unloads for s in registry.status()] == [1, 1]
    finally:
        registry.close()


def test_the_least_recently_used_idle_model_makes_room(folders: dict[str, Path]) -> None:
    import mlx.core as mx

    loads = Loads()
    one = weight_file_bytes(folders[A])
    registry = _registry(folders, loads, keep_alive=0, memory_budget=int(one * 1.5))
    with live_server(registry, FAST) as url:
        assert _states(url) == {A: "loaded", B: "unloaded"}
        held = mx.get_active_memory()
        assert chat_body(post(url, CHAT, _chat(B))).model == B
        assert _states(url) == {A: "unloaded", B: "loaded"}
        # A's weights went back: memory holds one model, not two
        assert mx.get_active_memory() < held + one // 2
        assert chat_body(post(url, CHAT, _chat(A))).model == A
        assert _states(url) == {A: "loaded", B: "unloaded"}
        assert (loads.count[A], loads.count[B]) == (2, 1)
        cards = {m["id"]: m for m in httpx.get(f"{url}/health", timeout=WAIT_S).json()["models"]}
        assert cards[B]["memory_bytes"] > one * 0.9  # measured from the loaded arrays


def test_a_load_bigger_than_its_estimate_still_keeps_the_budget(folders: dict[str, Path]) -> None:
    """A quantized file dequantized on a CPU takes several times its size: once the load
    has measured B, the idle A makes room after all."""
    loads = Loads()
    one = weight_file_bytes(folders[A])
    low = dataclasses.replace(loads.spec(folders[B], B), weight_bytes=1)
    registry = ModelRegistry(
        [loads.spec(folders[A], A), low], keep_alive=0, memory_budget=int(one * 1.5)
    )
    with live_server(registry, FAST) as url:
        assert chat_body(post(url, CHAT, _chat(B))).model == B
        _wait_states(url, {A: "unloaded", B: "loaded"})
        assert chat_body(post(url, CHAT, _chat(A))).model == A  # and B now measured
        assert _states(url) == {A: "loaded", B: "unloaded"}


# -- configuration -------------------------------------------------------------------------


CONFIG = """
[[models]]
source = "{a}"
id = "coder"
aliases = ["gpt-4o-mini", "claude-haiku-4-5"]
context_length = 4096
sampling = {{ temperature = 0.2, top_k = 20 }}

[[models]]
source = "{b}"
template_family = "qwen3"
parser = "hermes"
"""


def test_a_toml_config_lists_the_models(folders: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(CONFIG.format(a=folders[A], b=folders[B]))
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--keep-alive", "7", "--memory-budget", "2G",
         "--model-alias", "extra"]
    )  # fmt: skip
    registry = model_registry(args, EngineSettings())
    coder, second = registry.specs
    assert coder.names == ("coder", "claude-haiku-4-5", "extra", "gpt-4o-mini")
    assert second.id == B and second.source == str(folders[B])
    assert registry.keep_alive == 7 and registry.memory_budget == 2 * 1024**3
    # one budget: two models, so each one's caches get what its weights leave, at most
    # a quarter of RAM
    weights = weight_file_bytes(folders[A])
    quarter = int(physical_memory() * 0.25)
    assert coder.cache_bytes == min(2 * 1024**3 - weights, quarter)
    served = coder.build()
    try:
        assert served.context_length == 4096
        assert served.sampling_defaults == {"temperature": 0.2, "top_k": 20.0}
        assert served.runner is not None
        assert served.runner.settings.cache_memory_bytes == coder.cache_bytes
        assert served.runner.scheduler.memory_bytes == coder.cache_bytes
        assert served.runner.prefix.limit_bytes <= coder.cache_bytes
    finally:
        served.engine.stop()
    other = second.build()
    try:
        assert other.caps.parser == "hermes"
    finally:
        other.engine.stop()
    with live_server(registry, FAST) as url:
        ids = [c["id"] for c in httpx.get(f"{url}/v1/models", timeout=WAIT_S).json()["data"]]
        assert ids == ["coder", "claude-haiku-4-5", "extra", "gpt-4o-mini", B]
        assert chat_body(post(url, CHAT, _chat("gpt-4o-mini"))).model == "coder"


def test_one_model_gets_all_the_budget_leaves_for_its_caches(folders: dict[str, Path]) -> None:
    weights = weight_file_bytes(folders[A])
    args = build_parser().parse_args(["serve", "--model", str(folders[A]), "--memory-budget", "1G"])
    (spec,) = model_registry(args, EngineSettings()).specs
    assert spec.cache_bytes == 1024**3 - weights
    # a budget the weights alone fill still leaves the caches their floor
    assert cache_budget(weights, weights, 1) == MIN_CACHE_BYTES
    # the measured weights bound it too: a model bigger than its file gets less
    served = build_served(
        folders[A],
        model_id=A,
        settings=EngineSettings(memory_budget=weights + 3 * MIN_CACHE_BYTES,
                                cache_memory_bytes=1024**3),
    )  # fmt: skip
    try:
        assert served.runner is not None
        measured = served_bytes(served)
        assert measured is not None
        cache = served.runner.settings.cache_memory_bytes
        assert cache < 1024**3 and measured - cache > 0.9 * weights
    finally:
        served.engine.stop()


def test_a_relative_source_is_read_beside_the_config(folders: dict[str, Path]) -> None:
    path = folders[A].parent / "relative.toml"
    path.write_text(f'[[models]]\nsource = "{A}"\n')
    assert read_config(path) == [ModelConfig(source=str(folders[A].resolve()))]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("models = [", "not valid TOML"),
        ("[server]\nport = 1\n", "unknown key 'server'"),
        ("models = []\n", "lists no models"),
        ("[[models]]\nid = 'x'\n", "needs a source"),
        ("[[models]]\nsource = 'm'\nweights = 1\n", "unknown key 'weights'"),
        ("[[models]]\nsource = 'm'\naliases = [1]\n", "aliases must be a list"),
        ("[[models]]\nsource = 'm'\ncontext_length = '8k'\n", "context_length must be"),
        ("[[models]]\nsource = 'm'\nsampling = { temperature = -1 }\n", "out of range"),
        ("[[models]]\nsource = 'm'\nsampling = { beam = 2 }\n", "unknown field 'beam'"),
    ],
)
def test_config_mistakes_are_one_line_each(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(CliError, match=says) as caught:
        read_config(path)
    assert str(path) in caught.value.message and "\n" not in caught.value.message


def test_command_line_mistakes(folders: dict[str, Path], tmp_path: Path) -> None:
    def registry(*argv: str) -> ModelRegistry:
        return model_registry(build_parser().parse_args(["serve", *argv]), EngineSettings())

    a, b = str(folders[A]), str(folders[B])
    assert [s.id for s in registry("--model", a, "--model", b).specs] == [A, B]
    with pytest.raises(CliError, match="--model-id names one model"):
        registry("--model", a, "--model", b, "--model-id", "x")
    path = tmp_path / "one.toml"
    path.write_text(f'[[models]]\nsource = "{a}"\n')
    with pytest.raises(CliError, match="not both"):
        registry("--config", str(path), "--model", b)
    with pytest.raises(CliError, match="given to both"):
        registry("--model", a, "--model", a)
    dup = tmp_path / "dup.toml"
    dup.write_text(
        f'[[models]]\nsource = "{a}"\naliases = ["x"]\n[[models]]\nsource = "{b}"\nid = "x"\n'
    )
    with pytest.raises(CliError, match="'x' is given to both"):
        registry("--config", str(dup))
    bad = tmp_path / "parser.toml"
    bad.write_text(f'[[models]]\nsource = "{a}"\nparser = "nope"\n')
    with pytest.raises(CliError, match="unknown parser 'nope'"):
        registry("--config", str(bad))
    assert from_flags(["m"], "id", frozenset({"x"})) == [ModelConfig("m", "id", frozenset({"x"}))]
