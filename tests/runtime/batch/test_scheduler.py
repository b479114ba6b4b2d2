"""Continuous batching (runtime/batch/scheduler.py) against the oracle of running alone.

For tiny random models of every cache kind (KV, sliding window + KV, recurrent + KV,
MLA latents), concurrent greedy requests give exactly the tokens each gives alone with
batching off and the prefix cache off; cancelled requests end without disturbing the
rest; the prefix trie takes the finished sequences back; random arrival times change
nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import tests.support.tiny_models as tiny_models
from runtime.batch.generate import generate_tokens
from runtime.batch.scheduler import Scheduler
from runtime.cache.batch import BatchCaches
from runtime.engine import Engine
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.text.sampling import Sampler
from runtime.types import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TextDelta,
)
from tests.support.engine_kinds import KINDS as ENGINE_KINDS
from tests.support.engine_kinds import collect, folder_maker, prompt, together


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return folder_maker(tmp_path_factory)


def _request(prompt: tuple[int, ...], new: int, **sampling: Any) -> GenerationRequest:
    params = SamplingParams(**({"temperature": 0.0} | sampling))
    return GenerationRequest(prompt, new, params, prefill_chunk=16)


def _engine(folder: Path, *, max_batch: int, cache: bool, memory: int = 1 << 30) -> Engine:
    settings = RunnerSettings(
        prefill_chunk=16,
        max_batch=max_batch,
        prefix_cache_bytes=256 * 1024**2 if cache else 0,
        snapshot_interval=8,
        cache_memory_bytes=memory,
    )
    engine = Engine(ModelRunner(load(folder), settings), max_queue=64)
    engine.start()
    return engine


def _scheduler(engine: Engine) -> Scheduler:
    runner = engine._runner
    assert isinstance(runner, ModelRunner)
    return runner.scheduler


def _reference(folder: Path, request: GenerationRequest) -> list[int]:
    """The single-sequence loop (runtime/batch/generate.py) on fresh caches: no scheduler."""
    loaded = load(folder)
    eos = loaded.eos_token_ids
    sampler = Sampler(request.sampling, loaded.model.args.vocab_size, request.prompt_tokens)
    out: list[int] = []
    for sampled in generate_tokens(
        loaded.model, loaded.model.make_caches(), request.prompt_tokens, sampler,
        max_tokens=request.max_tokens, prefill_chunk=16,
    ):  # fmt: skip
        out.append(sampled.token_id)
        if sampled.token_id in eos:
            break
    return out


def _alone(folder: Path, requests: Sequence[GenerationRequest]) -> list[list[int]]:
    """Each request alone (batching and the prefix cache off), checked against the
    single-sequence loop."""
    engine = _engine(folder, max_batch=1, cache=False)
    try:
        alone = [collect(engine.submit(r))[0] for r in requests]
    finally:
        engine.stop()
    assert alone == [_reference(folder, r) for r in requests]
    return alone


def _mixed(vocab: int) -> list[GenerationRequest]:
    shared = prompt(40, 11, vocab)
    return [
        _request(prompt(7, 1, vocab), 12),
        _request(prompt(45, 2, vocab), 20),
        _request(shared + prompt(5, 3, vocab), 9),
        _request(shared + prompt(9, 4, vocab), 15),
        _request(prompt(1, 5, vocab), 6),  # a one-token prompt
        _request(prompt(23, 6, vocab), 17, logprobs=True, top_logprobs=3),
    ]


@pytest.mark.parametrize("name", list(ENGINE_KINDS))
@pytest.mark.parametrize("cache", [True, False])
def test_concurrent_greedy_requests_match_running_alone(
    name: str, cache: bool, folders: Callable[[str], Path]
) -> None:
    folder = folders(name)
    requests = _mixed(ENGINE_KINDS[name][1])
    expected = _alone(folder, requests)
    engine = _engine(folder, max_batch=8, cache=cache)
    try:
        got = together(engine, requests)
        runner = engine._runner
        assert isinstance(runner, ModelRunner)
        assert runner.scheduler.stats.max_batch_seen > 1  # they did run together
        again = together(engine, requests)  # now from the trie the first round filled
    finally:
        engine.stop()
    for (tokens, done), want in zip(got, expected, strict=True):
        assert tokens == want
        assert done.reason in (FinishReason.LENGTH, FinishReason.STOP)
    for (tokens, done), want in zip(again, expected, strict=True):
        assert tokens == want
        if cache:
            assert done.stats.cached_tokens > 0 or done.stats.prompt_tokens == 1


def test_logprobs_come_back_per_sequence(folders: Callable[[str], Path]) -> None:
    folder = folders("llama")
    requests = _mixed(tiny_models.VOCAB)
    engine = _engine(folder, max_batch=8, cache=False)
    try:
        got = together(engine, requests)
    finally:
        engine.stop()
    tokens, done = got[5]
    assert done.stats.completion_tokens == len(tokens)


def test_cancelled_sequences_leave_the_others_untouched(folders: Callable[[str], Path]) -> None:
    folder = folders("llama")
    vocab = tiny_models.VOCAB
    keep = [_request(prompt(30, s, vocab), 40) for s in (21, 22, 23)]
    expected = _alone(folder, keep)
    engine = _engine(folder, max_batch=8, cache=True)
    try:
        doomed = [engine.submit(_request(prompt(30, s, vocab), 200)) for s in (31, 32)]
        kept = [engine.submit(r) for r in keep]
        for handle in doomed:  # cancel each after its first token
            for event in handle:
                if isinstance(event, TextDelta):
                    handle.cancel()
                    break
        ends = [collect(h)[1] for h in doomed]
        results = [collect(h) for h in kept]
    finally:
        engine.stop()
    assert all(e.reason is FinishReason.CANCELLED for e in ends)
    assert [t for t, _ in results] == expected


def test_random_arrivals_change_nothing(folders: Callable[[str], Path]) -> None:
    """A property over random arrival times, lengths and batch sizes (seeded)."""
    for name in ("llama", "qwen3_next"):
        folder = folders(name)
        vocab = ENGINE_KINDS[name][1]
        rng = random.Random(7)
        requests = [
            _request(prompt(rng.randint(1, 50), 100 + i, vocab), rng.randint(1, 16))
            for i in range(7)
        ]
        expected = _alone(folder, requests)
        for trial in range(2):
            delays = [rng.uniform(0, 0.3) for _ in requests]
            engine = _engine(folder, max_batch=rng.choice([2, 3, 8]), cache=bool(trial % 2))
            try:
                got = together(engine, requests, delays)
            finally:
                engine.stop()
            assert [t for t, _ in got] == expected, (name, trial)


def test_batch_cache_rows_round_trip(folders: Callable[[str], Path]) -> None:
    """Rows joined into a batch come back out as the caches they went in as."""
    model = load(folders("gemma3_text")).model
    rows = []
    for n, seed in ((5, 1), (13, 2), (30, 3)):  # 30 > the sliding window of 8
        caches = model.make_caches()
        model.forward(mx.array([prompt(n, seed, tiny_models.VOCAB)]), caches)
        rows.append(caches)
    batch = BatchCaches(rows[0])
    for caches in rows:
        batch.add(caches)
    batch.remove([1])
    for i, original in zip((0, 1), (rows[0], rows[2]), strict=True):
        back = batch.row(i)
        for a, b in zip(back, original, strict=True):
            assert a.offset == b.offset and type(a) is type(b)
            sa, sb = a.snapshot(0), b.snapshot(0)
            assert sa is not None and sb is not None
            for x, y in zip(sa.arrays, sb.arrays, strict=True):
                assert np.array_equal(np.array(x), np.array(y))


def test_a_request_that_would_not_fit_waits_its_turn(folders: Callable[[str], Path]) -> None:
    """With room for one sequence's caches, the rest wait in line (nothing fails)."""
    folder = folders("llama")
    requests = _mixed(tiny_models.VOCAB)[:4]
    expected = _alone(folder, requests)
    engine = _engine(folder, max_batch=8, cache=True, memory=64 * 1024)
    try:
        got = together(engine, requests)
        runner = engine._runner
        assert isinstance(runner, ModelRunner)
        assert runner.scheduler.stats.max_batch_seen == 1
    finally:
        engine.stop()
    assert [t for t, _ in got] == expected


@pytest.mark.parametrize(
    ("name", "mode"),
    [("llama", "fused"), ("llama", "layered"), ("llama", "short"), ("gemma3_text", "fused")],
)
def test_prefill_chunks_ride_on_decode_steps(
    name: str, mode: str, folders: Callable[[str], Path]
) -> None:
    """Prompts that arrive while others decode are read in the decode steps' forwards
    (one forward for both, runtime/cache/ragged.py), or a few layers per step between
    them (runtime/batch/layered_prefill.py, the CPU's way for a plain stack's long prompts;
    "short": these prompts are short enough to ride there too), and every request
    still gets the tokens it gets alone. gemma3's 45-token prompts pass its sliding
    window of 8."""
    folder = folders(name)
    vocab = ENGINE_KINDS[name][1]
    running = [_request(prompt(5, 40 + i, vocab), 60) for i in range(2)]
    arriving = [_request(prompt(45, 50 + i, vocab), 10) for i in range(3)]
    expected = _alone(folder, [*running, *arriving])
    for cache in (False, True):
        engine = _engine(folder, max_batch=8, cache=cache)
        scheduler = _scheduler(engine)
        assert scheduler.layered == (name == "llama")  # the CPU's way for a plain stack
        scheduler.layered = mode != "fused"
        if mode == "layered":
            scheduler._layer_pace.min_prompt = 0  # however short
        try:
            first = [engine.submit(r) for r in running]
            for handle in first:  # they decode before the long prompts come
                next(e for e in handle if isinstance(e, TextDelta))
            later = together(engine, arriving)
            results = [collect(h) for h in first]
            runner = engine._runner
            assert isinstance(runner, ModelRunner)
            stats = runner.scheduler.stats
        finally:
            engine.stop()
        assert (stats.layered_steps if mode == "layered" else stats.fused_steps) > 0
        assert stats.layered_steps == 0 or mode == "layered"
        firsts = [expected[i][:1] + t for i, (t, _) in enumerate(results)]
        assert firsts == expected[:2]
        assert [t for t, _ in later] == expected[2:]


def test_the_trie_gives_way_to_the_running_batch(folders: Callable[[str], Path]) -> None:
    """One memory bound for the batch and the prefix trie: while rows run, the trie may
    hold only what their caches (at their longest) leave, and it holds no more; once they
    end it may grow back to its own budget. The tokens are those of each request alone."""
    folder = folders("llama")
    requests = [_request(prompt(40, 70 + i, tiny_models.VOCAB), 30) for i in range(3)]
    expected = _alone(folder, requests)
    engine = _engine(folder, max_batch=8, cache=True, memory=256 * 1024)
    runner = engine._runner
    assert isinstance(runner, ModelRunner)
    prefix, scheduler = runner.prefix, runner.scheduler
    seen: list[tuple[int, int]] = []  # (limit, bytes held) after every change of limit
    set_limit = prefix.set_limit

    def recording(limit: int) -> None:
        set_limit(limit)
        seen.append((prefix.limit_bytes, prefix.stats()["paged_bytes"]))

    prefix.set_limit = recording  # type: ignore[method-assign]
    try:
        got = together(engine, requests)
    finally:
        engine.stop()
    assert [t for t, _ in got] == expected
    assert scheduler.stats.max_batch_seen > 1
    assert all(held <= limit for limit, held in seen)
    lowest = min(limit for limit, _ in seen)
    assert lowest < prefix.budget_bytes  # the running rows took their share
    assert seen[-1][0] == min(prefix.budget_bytes, 256 * 1024)  # and gave it back


@pytest.mark.parametrize("name", list(ENGINE_KINDS))
def test_one_prompt_twice_at_once_writes_two_sets_of_buffers(
    name: str, folders: Callable[[str], Path]
) -> None:
    """Two requests for one cached prompt, the second joining while the first decodes:
    both start from the trie's live caches at the same position, with no prompt token
    left to write there. Rows written in place (runtime/cache/rows.py) must not share
    those buffers: a window or hybrid model's trie keeps its live caches, so the second
    row would write its own tokens over the first's columns (and they differ: one greedy,
    one sampled). Each gets what it gets alone."""
    folder = folders(name)
    vocab = ENGINE_KINDS[name][1]
    text = prompt(30, 21, vocab)
    greedy = _request(text, 40)
    sampled = _request(text, 12, temperature=1.0, seed=7)
    expected = _alone(folder, [greedy, sampled])
    assert expected[0][:12] != expected[1]  # they write different tokens
    engine = _engine(folder, max_batch=8, cache=True)
    try:
        collect(engine.submit(greedy))  # the trie now holds the prompt
        first = engine.submit(greedy)
        head = next(e for e in first if isinstance(e, TextDelta))  # decoding
        second = collect(engine.submit(sampled))
        rest = collect(first)
        stats = _scheduler(engine).stats
    finally:
        engine.stop()
    assert stats.max_batch_seen > 1  # they did run together
    assert second[0] == expected[1]
    assert list(head.token_ids) + rest[0] == expected[0]
    assert second[1].stats.cached_tokens == len(text) - 1
