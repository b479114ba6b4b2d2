"""How the scheduler paces prefill chunks between decode steps (runtime/batch/pacing.py).

The step times come from a scripted clock, so every number here is exact: a plain
decode step's time is the median of the last few, each measured only after a plain
decode step (one right after prefill work
also waits for that work's tail), a chunk's tokens are timed without the forward's
fixed cost (one decode step), and a chunk is sized so that its step takes
FUSED_SHARE (riding on a decode step) or PREFILL_SHARE (alone) decode steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import runtime.batch.pacing as pacing_module
from runtime.batch.handle import RequestHandle, ThreadSink
from runtime.batch.scheduler import Scheduler
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.types import GenerationRequest, SamplingParams
from tests.support.engine_kinds import KINDS, folder_maker, prompt

VOCAB = KINDS["llama"][1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return folder_maker(tmp_path_factory)


class Clock:
    """Each reading is `tick` seconds after the one before."""

    def __init__(self) -> None:
        self.now = 0.0
        self.tick = 0.2

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _runner(folder: Path) -> tuple[ModelRunner, Scheduler, Clock]:
    # plain decode steps only: a speculative verify step is timed apart from them
    settings = RunnerSettings(
        prefill_chunk=64, max_batch=4, prefix_cache_bytes=0, speculative="off"
    )
    runner = ModelRunner(load(folder), settings)
    clock = Clock()
    runner.scheduler.clock = clock
    runner.scheduler.layered = (
        False  # token chunks (tests/runtime/batch/test_layered_prefill.py: layers)
    )
    return runner, runner.scheduler, clock


def _admit(runner: ModelRunner, n: int, seed: int, new: int) -> RequestHandle:
    request = GenerationRequest(prompt(n, seed, VOCAB), new, SamplingParams(temperature=0.0))
    handle = RequestHandle(request, ThreadSink())
    runner.admit(handle)
    return handle


def test_a_decode_step_right_after_prefill_work_is_not_taken_as_a_decode_step(
    folders: Callable[[str], Path],
) -> None:
    runner, sched, clock = _runner(folders("llama"))
    _admit(runner, 6, 1, 40)
    for _ in range(4):  # its prompt, then plain decode steps of 0.2 s
        runner.step()
    assert sched.stats.running == 1
    assert sched.stats.decode_step_seconds == pytest.approx(0.2)
    _admit(runner, 6, 2, 40)
    runner.step()  # a plain decode step, then the new prompt read apart
    assert sched.stats.running == 2
    clock.tick = 1.0  # the step after that work waits for its tail
    runner.step()
    assert sched.stats.running == 2
    assert sched.stats.decode_step_seconds == pytest.approx(0.2)
    clock.tick = 0.3  # settled again: two rows decode in 0.3 s
    for _ in range(3):
        runner.step()
    assert sched.stats.decode_step_seconds == pytest.approx(0.2)  # 4 of 0.2 s, 3 of 0.3 s
    for _ in range(2):
        runner.step()
    assert sched.stats.decode_step_seconds == pytest.approx(0.3)
    clock.tick = 5.0  # one step held up (the engine thread busy elsewhere)
    runner.step()
    assert sched.stats.decode_step_seconds == pytest.approx(0.3)


def test_a_chunk_is_timed_without_the_forwards_fixed_cost(folders: Callable[[str], Path]) -> None:
    _, sched, _ = _runner(folders("llama"))
    pacing = sched.pacing
    pacing.decode_step_seconds = 0.2
    pacing.measured_chunk(40, 0.6)  # 0.2 s of it is the fixed cost: 40 tokens in 0.4 s
    assert pacing.prefill_rate == pytest.approx(100.0)
    pacing.measured_chunk(10, 0.22)  # no less than a quarter of the chunk's time: 0.055 s
    assert pacing.prefill_rate == pytest.approx(0.7 * 100.0 + 0.3 * 10 / 0.055)


def test_chunks_leave_one_decode_step_for_the_fixed_cost(
    folders: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, sched, _ = _runner(folders("llama"))
    _admit(runner, 6, 1, 40)
    for _ in range(3):
        runner.step()
    _admit(runner, 300, 2, 4)
    seq = sched._queue[0]
    sched.pacing.decode_step_seconds, sched.pacing.prefill_rate = 0.2, 1000.0
    monkeypatch.setattr(sched, "_rider", lambda: seq)
    fused = (pacing_module.FUSED_SHARE - 1) * 0.2 * 1000.0
    assert sched._chunk(seq) == min(64, int(fused))
    sched.pacing.prefill_rate = 100.0
    assert sched._chunk(seq) == int((pacing_module.FUSED_SHARE - 1) * 0.2 * 100.0)
    sched.pacing.prefill_rate = 10.0  # a slow prompt still takes the floor's tokens
    assert sched._chunk(seq) == pacing_module.MIN_FUSED_CHUNK
    monkeypatch.setattr(sched, "_rider", lambda: None)  # a chunk run apart
    sched.pacing.prefill_rate = 1000.0
    alone = (pacing_module.PREFILL_SHARE - 1) * 0.2 * 1000.0
    assert sched._chunk(seq) == max(pacing_module.MIN_PREFILL_CHUNK, min(64, int(alone)))
