"""The prefix trie over quantized KV caches (`--kv-bits`): the live state lent to a batch
row and taken back (runtime/prefix/loan.py), and the disk tier, whose files record the
bits and which a server with other bits does not read. The oracle: with greedy decoding,
the single-sequence loop on fresh caches of the same bits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.batch.generate import generate_tokens
from runtime.batch.handle import RequestHandle, open_handle
from runtime.cache import QuantizedKVCache, codec, quantizing
from runtime.engine import Engine
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.prefix.disk.files import SUFFIX, read_header
from runtime.text.sampling import Sampler
from runtime.types import Finished, GenerationRequest, SamplingParams, TextDelta
from tests.support.engine_kinds import KINDS, collect, folder_maker, prompt

VOCAB = KINDS["llama"][1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return folder_maker(tmp_path_factory)("llama")


def _request(tokens: tuple[int, ...], new: int) -> GenerationRequest:
    return GenerationRequest(tokens, new, SamplingParams(temperature=0.0), prefill_chunk=16)


def _reference(folder: Path, request: GenerationRequest, bits: int | None) -> list[int]:
    loaded = load(folder)
    sampler = Sampler(request.sampling, loaded.model.args.vocab_size, request.prompt_tokens)
    caches = quantizing(loaded.model.make_caches, bits)()
    out = []
    for sampled in generate_tokens(
        loaded.model, caches, request.prompt_tokens, sampler,
        max_tokens=request.max_tokens, prefill_chunk=16,
    ):  # fmt: skip
        out.append(sampled.token_id)
        if sampled.token_id in loaded.eos_token_ids:
            break
    return out


def _runner(folder: Path, bits: int | None, **more: Any) -> ModelRunner:
    fields: dict[str, Any] = {
        "prefill_chunk": 16, "max_batch": 8, "prefix_cache_bytes": 64 * 1024**2,
        "snapshot_interval": 8, "kv_bits": bits,
    }  # fmt: skip
    return ModelRunner(load(folder), RunnerSettings(**{**fields, **more}))


class _Run:
    """Requests admitted to a runner the test steps by hand."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.finished: dict[int, Finished] = {}

    def admit(self, request: GenerationRequest) -> RequestHandle:
        handle = open_handle(request)
        self.runner.admit(handle)
        return handle

    def step_until(self, done: Callable[[], bool], limit: int = 500) -> None:
        for _ in range(limit):
            if done():
                return
            for handle, fin in self.runner.step():
                self.finished[id(handle)] = fin
        raise AssertionError("the condition never came true")

    def tokens(self, handle: RequestHandle) -> list[int]:
        self.step_until(lambda: id(handle) in self.finished)
        out: list[int] = []
        sink: Any = handle._sink
        while not sink.queue.empty():
            event = sink.queue.get_nowait()
            if isinstance(event, TextDelta):
                out += event.token_ids
        return out


def test_a_quantized_prompt_is_lent_to_its_row_taken_back_and_handed_over(folder: Path) -> None:
    shared = prompt(50, 3, VOCAB)
    first, second = _request(shared, 30), _request(shared + prompt(7, 4, VOCAB), 8)
    run = _Run(_runner(folder, 8))
    prefix, scheduler = run.runner.prefix, run.runner.scheduler
    assert all(isinstance(c, QuantizedKVCache) for c in prefix._caches)
    a = run.admit(first)
    run.step_until(lambda: len(scheduler.running) == 1)
    # one copy: the row writes into the codes prefill filled; the trie's caches are empty
    assert prefix._loan is not None and all(c.nbytes == 0 for c in prefix._caches)
    b = run.admit(second)  # takes the prompt back from the row while it runs
    run.step_until(lambda: len(scheduler.running) == 2)
    assert run.tokens(b) == _reference(folder, second, 8)
    assert run.finished[id(b)].stats.cached_tokens == len(shared)
    assert run.tokens(a) == _reference(folder, first, 8)
    run.step_until(lambda: scheduler.idle)
    prefix.verify()
    # the conversation goes on from what the rows handed back
    follow = _request(first.prompt_tokens + tuple(_reference(folder, first, 8)), 5)
    c = run.admit(follow)
    assert run.tokens(c) == _reference(folder, follow, 8)
    assert run.finished[id(c)].stats.cached_tokens >= len(first.prompt_tokens)


def _engine(folder: Path, bits: int | None, directory: Path, budget: int) -> Engine:
    runner = _runner(
        folder, bits, max_batch=2, prefix_cache_bytes=budget, prefix_cache_dir=directory,
        prefix_cache_disk_bytes=1 << 30,
    )  # fmt: skip
    engine = Engine(runner, max_queue=8)
    engine.start()
    return engine


def _disk_loads(engine: Engine) -> int:
    runner = engine._runner
    assert isinstance(runner, ModelRunner)
    return runner.prefix.stats()["disk_loads"]


def _conversation(engine: Engine) -> list[tuple[list[int], int]]:
    """A prompt, then the same prompt continued: tokens and cached tokens of each."""
    out = []
    first = prompt(40, 11, VOCAB)
    for tokens in (first, first + prompt(6, 12, VOCAB)):
        got, done = collect(engine.submit(_request(tokens, 6)))
        assert done.error is None
        out.append((got, done.stats.cached_tokens))
    return out


def test_the_disk_tier_keeps_the_bits_and_other_bits_never_read_them(
    folder: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "prefix"
    first = prompt(40, 11, VOCAB)
    want = [
        _reference(folder, _request(first, 6), 8),
        _reference(folder, _request(first + prompt(6, 12, VOCAB), 6), 8),
    ]
    # a byte of memory: every state paged out goes to disk and comes back from there
    engine = _engine(folder, 8, directory, budget=1)
    try:
        got = _conversation(engine)
    finally:
        engine.stop()  # writes what the live caches hold
    assert [t for t, _ in got] == want and got[1][1] > 0
    files = sorted(directory.glob("*" + SUFFIX))
    assert files
    runner = _runner(folder, 8, prefix_cache_dir=directory, prefix_cache_disk_bytes=1 << 30)
    identity = runner.prefix._disk.tier.identity  # type: ignore[union-attr]
    runner.close()
    header, _ = read_header(files[0], identity)
    kinds = {m.layout.kind for m in header.layers.values()}
    assert kinds == {codec.KV_QUANTIZED}
    assert {m.layout.params["bits"] for m in header.layers.values()} == {8}
    assert {m.dtypes[0] for m in header.layers.values()} == {"uint32"}
    # a restart with the same bits hits on its first request, from disk
    engine = _engine(folder, 8, directory, budget=64 * 1024**2)
    try:
        again = _conversation(engine)
        loads = _disk_loads(engine)
    finally:
        engine.stop()
    assert [t for t, _ in again] == want and again[0][1] > 0 and loads > 0
    # other bits (4, or none) read nothing of it: their first request computes it all
    for bits in (4, None):
        engine = _engine(folder, bits, directory, budget=64 * 1024**2)
        try:
            other = _conversation(engine)
            loads = _disk_loads(engine)
        finally:
            engine.stop()
        assert other[0][1] == 0 and loads == 0
        assert [t for t, _ in other] == [
            _reference(folder, _request(first, 6), bits),
            _reference(folder, _request(first + prompt(6, 12, VOCAB), 6), bits),
        ]
