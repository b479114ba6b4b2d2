"""A joined prompt's keys and values are held once (runtime/prefix/loan.py).

When a prompt is in, the trie records it and the sequence joins the batch. With plain KV
layers the trie lends its live state to the batch row instead of keeping a copy: the
row's buffers are the ones prefill filled, the trie takes the prompt back (a copy) only
when the next request begins while the row still runs, and a finished row's buffers go
back to the trie as they are. The oracle is the single-sequence loop on fresh caches;
the scheduler is stepped by hand, so the state between steps can be looked at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import mlx.core as mx
import numpy as np

from runtime.batch.generate import generate_tokens
from runtime.batch.handle import RequestHandle, open_handle
from runtime.cache.batch import BatchCaches, BatchTokenCache
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.text.sampling import Sampler
from runtime.types import (
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TextDelta,
)
from tests.support.engine_kinds import KINDS, folder_maker, prompt


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return folder_maker(tmp_path_factory)


def _request(tokens: tuple[int, ...], new: int) -> GenerationRequest:
    return GenerationRequest(tokens, new, SamplingParams(temperature=0.0), prefill_chunk=16)


def _runner(folder: Path) -> ModelRunner:
    settings = RunnerSettings(
        prefill_chunk=16, max_batch=8, prefix_cache_bytes=64 * 1024**2, snapshot_interval=8
    )
    return ModelRunner(load(folder), settings)


def _reference(folder: Path, request: GenerationRequest) -> list[int]:
    loaded = load(folder)
    sampler = Sampler(request.sampling, loaded.model.args.vocab_size, request.prompt_tokens)
    out = []
    for sampled in generate_tokens(
        loaded.model, loaded.model.make_caches(), request.prompt_tokens, sampler,
        max_tokens=request.max_tokens, prefill_chunk=16,
    ):  # fmt: skip
        out.append(sampled.token_id)
        if sampled.token_id in loaded.eos_token_ids:
            break
    return out


class _Run:
    """Requests admitted to a runner that the test steps by hand."""

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

    @property
    def joined(self) -> int:
        return len(self.runner.scheduler.running)


def test_the_row_borrows_the_prompt_and_hands_it_back(folders: Callable[[str], Path]) -> None:
    folder = folders("llama")
    vocab = KINDS["llama"][1]
    first = _request(prompt(60, 1, vocab), 12)
    run = _Run(_runner(folder))
    prefix, scheduler = run.runner.prefix, run.runner.scheduler
    handle = run.admit(first)
    run.step_until(lambda: run.joined == 1)
    # one copy: the batch writes into the buffers prefill filled; the trie's are empty
    assert prefix._loan is not None
    assert all(c.keys is None and c.nbytes == 0 for c in prefix._caches)
    prefix.verify()
    out = run.tokens(handle)
    assert out == _reference(folder, first)
    run.step_until(lambda: scheduler.idle)
    # the finished row's buffers went back to the trie as they were
    assert prefix._loan is None and prefix.stats()["adopted"] == 1
    (held,) = {c.offset for c in prefix._caches}  # the last token's keys may be in too
    assert held in (len(first.prompt_tokens) + len(out) - 1, len(first.prompt_tokens) + len(out))
    prefix.verify()
    # the conversation goes on: all of it is reused
    turn = first.prompt_tokens + tuple(out) + prompt(5, 2, vocab)
    follow = _request(turn, 6)
    handle = run.admit(follow)
    assert run.tokens(handle) == _reference(folder, follow)
    assert run.finished[id(handle)].stats.cached_tokens == held


def test_the_next_request_takes_the_prompt_back_while_the_row_runs(
    folders: Callable[[str], Path],
) -> None:
    folder = folders("llama")
    vocab = KINDS["llama"][1]
    shared = prompt(50, 3, vocab)
    first, second = _request(shared, 40), _request(shared + prompt(7, 4, vocab), 8)
    run = _Run(_runner(folder))
    prefix = run.runner.prefix
    a = run.admit(first)
    run.step_until(lambda: run.joined == 1)
    assert prefix._loan is not None
    b = run.admit(second)
    run.step_until(lambda: run.joined == 2)
    assert prefix._loan is None or prefix._loan.end > len(shared)  # taken back, maybe lent anew
    assert run.tokens(b) == _reference(folder, second)
    assert run.finished[id(b)].stats.cached_tokens == len(shared)
    assert run.tokens(a) == _reference(folder, first)
    run.step_until(lambda: run.runner.scheduler.idle)
    prefix.verify()


@pytest.mark.parametrize("row_gone", [False, True])
def test_an_aborted_row_gives_its_prompt_back_unless_it_is_gone(
    row_gone: bool, folders: Callable[[str], Path]
) -> None:
    """A failed step aborts the batch: the trie takes its lent prompt back first, and
    drops its live path when the row's arrays cannot be had (never a wrong state)."""
    folder = folders("llama")
    vocab = KINDS["llama"][1]
    shared = prompt(40, 5, vocab)
    run = _Run(_runner(folder))
    prefix = run.runner.prefix
    run.admit(_request(shared, 30))
    run.step_until(lambda: run.joined == 1)
    assert prefix._loan is not None
    if row_gone:
        prefix._loan = dataclasses.replace(prefix._loan, source=lambda: None)
    run.runner.abort(FinishReason.ERROR, "a failed step")
    assert prefix._loan is None
    prefix.verify()
    later = _request(shared + prompt(4, 6, vocab), 6)
    handle = run.admit(later)
    assert run.tokens(handle) == _reference(folder, later)
    want = 0 if row_gone else len(shared)
    assert run.finished[id(handle)].stats.cached_tokens == want
    prefix.verify()


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next"])
def test_windows_and_recurrent_states_are_not_lent(
    name: str, folders: Callable[[str], Path]
) -> None:
    """A sliding window or a recurrent state cannot be taken back from a row that has
    decoded on: the trie keeps its own copy."""
    folder = folders(name)
    run = _Run(_runner(folder))
    prefix = run.runner.prefix
    first = _request(prompt(30, 7, KINDS[name][1]), 5)
    handle = run.admit(first)
    run.step_until(lambda: run.joined == 1)
    assert prefix._loan is None
    assert all(c.offset == len(first.prompt_tokens) for c in prefix._caches)
    assert run.tokens(handle) == _reference(folder, first)


def test_the_first_row_takes_the_buffers_and_the_last_gives_them_back(
    folders: Callable[[str], Path],
) -> None:
    """A row's writes never show in the cache it came from (the gemma3 and hybrid
    tries keep theirs), and cost no copy once that cache lets go of its buffers."""
    model = load(folders("llama")).model

    def filled() -> list[Any]:
        caches = model.make_caches()
        model.forward(mx.array([prompt(20, 8, KINDS["llama"][1])]), caches)
        mx.eval([a for c in caches for a in c.state])
        return caches

    def write(batch: BatchCaches) -> None:
        for layer in batch.layers:
            assert isinstance(layer, BatchTokenCache) and layer.keys is not None
            _, heads, _, dim = layer.keys.shape
            token = mx.ones((1, heads, 1, dim), dtype=layer.keys.dtype)
            mx.eval(layer.update_and_fetch(token, token))

    kept = filled()
    before = [np.array(c.keys) for c in kept]
    batch = BatchCaches(kept)
    batch.add(kept)
    write(batch)
    assert all(np.array_equal(np.array(c.keys), b) for c, b in zip(kept, before, strict=True))

    lent = filled()
    batch = BatchCaches(lent)
    batch.add(lent)
    buffer = int(lent[0].nbytes)
    for c in lent:
        c.free()  # as the trie does when it lends its live state
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    write(batch)
    assert mx.get_peak_memory() - start < buffer // 2  # written in place
    back = batch.row(0)
    batch.remove([0])
    mx.eval([a for c in back for a in c.state])
    assert mx.get_active_memory() - start < buffer // 2  # handed back, not copied
    assert all(r.offset == 21 for r in back)
