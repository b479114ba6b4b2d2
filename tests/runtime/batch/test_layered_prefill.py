"""Prompts read a few layers per step (runtime/batch/layered_prefill.py).

A chunk taken through the layers in several steps leaves every layer's cache exactly as
one forward of the same chunk does, records the trie's snapshot points inside it, and,
given up halfway, leaves the caches at its start; the scheduler sizes the steps from a
token's time through a layer, and a request cancelled with a chunk on its way leaves
the trie a prefix that later requests reuse and get their own tokens from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime.batch.generate import generate_tokens
from runtime.batch.handle import RequestHandle, ThreadSink
from runtime.batch.layered_prefill import (
    FIRST_LAYERED_CHUNK,
    LAYERED_CHUNK,
    LAYERED_SHARE,
    MIN_LAYERED_CHUNK,
    LayeredChunk,
    LayerPace,
    layer_stack,
)
from runtime.batch.prompt_prefill import PromptPrefill
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.text.sampling import Sampler
from runtime.types import FinishReason, GenerationRequest, SamplingParams
from tests.support.engine_kinds import KINDS, collect, folder_maker, prompt

VOCAB = KINDS["llama"][1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return folder_maker(tmp_path_factory)


def _prefill(model: Any, tokens: tuple[int, ...], points: tuple[int, ...]) -> PromptPrefill:
    lease: Any = SimpleNamespace(
        caches=model.make_caches(), reused=0, snapshot_points=points, tokens=tokens
    )
    return PromptPrefill(lease, tokens)


def _states(caches: list[Any]) -> list[np.ndarray[Any, Any]]:
    return [np.array(c.state[i][..., : c.offset, :]) for c in caches for i in (0, 1)]


def test_only_plain_stacks_over_kv_caches_go_layer_by_layer(
    folders: Callable[[str], Path],
) -> None:
    assert layer_stack(load(folders("llama")).model) is not None
    for name in ("gemma3_text", "qwen3_next", "deepseek_v3"):  # window, recurrent, latent
        assert layer_stack(load(folders(name)).model) is None, name


@pytest.mark.parametrize("per_step", [1, 2])
def test_a_chunk_taken_layer_by_layer_fills_the_caches_as_one_forward(
    per_step: int, folders: Callable[[str], Path]
) -> None:
    model = load(folders("llama")).model
    stack = layer_stack(model)
    assert stack is not None
    tokens = prompt(41, 5, VOCAB)
    whole, layered = _prefill(model, tokens, (10, 30)), _prefill(model, tokens, (10, 30))
    seen: dict[str, list[int]] = {"whole": [], "layered": []}
    while not whole.done:
        whole.run(model, 16, seen["whole"].append)
    steps = 0
    while not layered.done:
        chunk = LayeredChunk(stack, layered, 16, seen["layered"].append)
        while not chunk.done:
            chunk.run(per_step)
            steps += 1
        chunk.finish(seen["layered"].append)
    assert steps == 3 * -(-len(stack.layers) // per_step)  # 40 tokens: chunks of 16, 16, 8
    assert seen["layered"] == seen["whole"] == [10, 30]
    assert layered.offset == whole.offset == 40
    for a, b in zip(_states(layered.caches), _states(whole.caches), strict=True):
        assert np.array_equal(a, b)


def test_a_chunk_given_up_halfway_leaves_the_caches_at_its_start(
    folders: Callable[[str], Path],
) -> None:
    model = load(folders("llama")).model
    stack = layer_stack(model)
    assert stack is not None
    tokens = prompt(41, 6, VOCAB)
    prefill, reference = _prefill(model, tokens, ()), _prefill(model, tokens, ())
    reference.run(model, 16, lambda _: None)
    chunk = LayeredChunk(stack, prefill, 16, lambda _: None)
    chunk.run(16)
    chunk.finish(lambda _: None)
    second = LayeredChunk(stack, prefill, 16, lambda _: None)
    second.run(1)
    assert [c.offset for c in prefill.caches] == [32, 16]
    second.undo()
    assert [c.offset for c in prefill.caches] == [16, 16]
    assert prefill.offset == 16
    for a, b in zip(_states(prefill.caches), _states(reference.caches), strict=True):
        assert np.array_equal(a, b)


def test_steps_are_sized_from_a_tokens_time_through_a_layer() -> None:
    pace = LayerPace()
    step = 0.2  # a plain decode step; a step may take LAYERED_SHARE of them
    budget = (LAYERED_SHARE - 1) * step
    assert pace.tokens(4096, step, 24) == FIRST_LAYERED_CHUNK  # nothing measured yet:
    assert pace.fit(FIRST_LAYERED_CHUNK, step, 24) == 0  # one layer, sized once measured
    pace.measured(1000, 0.1)  # 0.1 ms a token through a layer
    assert pace.seconds == pytest.approx(1e-4)
    # LAYERED_CHUNK tokens need `need` layers a step; the 24 layers go in equal steps of
    # at least that many, with the tokens that fill a step of those
    need = math.ceil(budget / (LAYERED_CHUNK * 1e-4))
    per_step = math.ceil(24 / (24 // need))
    assert per_step >= need and 24 % per_step == 0
    tokens = int(budget / (per_step * 1e-4))
    assert tokens <= LAYERED_CHUNK
    assert pace.tokens(4096, step, 24) == tokens
    assert pace.fit(tokens, step, 24) == per_step
    assert pace.tokens(256, step, 24) == 256  # the request's prefill chunk bounds it
    assert pace.tokens(4096, step, 2) == int(budget / 2e-4)  # a small model's all in a step
    # a short prompt's chunk goes through as many layers as its own tokens fit
    fits = int(budget / (100 * 1e-4))
    assert pace.fit(100, step, 24) == math.ceil(24 / math.ceil(24 / fits)) == 24
    assert pace.fit(FIRST_LAYERED_CHUNK, step, 24) == math.ceil(
        24 / math.ceil(24 / int(budget / (FIRST_LAYERED_CHUNK * 1e-4)))
    )
    pace.measured(10, 1.0)  # a slow model: one layer, never fewer than the floor's tokens
    assert pace.seconds == pytest.approx(0.7 * 1e-4 + 0.3 * 0.1)
    assert pace.tokens(4096, step, 24) == MIN_LAYERED_CHUNK
    assert pace.fit(MIN_LAYERED_CHUNK, step, 24) == 1


def _alone(folder: Path, tokens: tuple[int, ...], new: int) -> list[int]:
    loaded = load(folder)
    sampler = Sampler(SamplingParams(temperature=0.0), loaded.model.args.vocab_size, tokens)
    run = generate_tokens(loaded.model, loaded.model.make_caches(), tokens, sampler,
                          max_tokens=new, prefill_chunk=16)  # fmt: skip
    return [s.token_id for s in run]


def test_a_prompt_cancelled_halfway_through_a_chunk_leaves_a_sound_prefix(
    folders: Callable[[str], Path],
) -> None:
    folder = folders("llama")
    settings = RunnerSettings(prefill_chunk=16, max_batch=4, prefix_cache_bytes=64 << 20,
                              snapshot_interval=8)  # fmt: skip
    runner = ModelRunner(load(folder), settings)
    sched = runner.scheduler
    assert sched.layered
    pace = sched._layer_pace
    pace.min_prompt = 0  # these prompts are short
    pace.tokens = lambda cap, step, layers: 16  # type: ignore[method-assign]
    pace.fit = lambda tokens, step, layers: 1  # type: ignore[method-assign]

    def admit(tokens: tuple[int, ...], new: int) -> RequestHandle:
        request = GenerationRequest(tokens, new, SamplingParams(temperature=0.0))
        handle = RequestHandle(request, ThreadSink())
        runner.admit(handle)
        return handle

    def step() -> None:
        for handle, finished in runner.step():
            handle.finish(finished)

    running = admit(prompt(6, 1, VOCAB), 30)
    while sched.stats.running == 0 or sched.stats.decode_step_seconds <= 0:
        step()
    long = prompt(41, 2, VOCAB)
    cancelled = admit(long, 5)
    while not (sched._queue and sched._queue[0].prefill and sched._queue[0].prefill.offset):
        step()  # the first chunk goes through both layers, one per step
    step()  # the second chunk through the first layer only
    chunk = sched._queue[0].layered
    assert chunk is not None and chunk.next == 1
    cancelled.cancel()
    step()
    assert collect(cancelled)[1].reason is FinishReason.CANCELLED
    later = admit(long, 8)
    while not sched.idle:
        step()
    tokens, finished = collect(later)
    assert finished.stats.cached_tokens == 16  # the first chunk, from the trie
    assert tokens == _alone(folder, long, 8)
    assert collect(running)[0] == _alone(folder, prompt(6, 1, VOCAB), 30)
    mx.clear_cache()
