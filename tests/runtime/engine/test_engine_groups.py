"""Engine.submit_all: the n generations of one API request are queued back to back, all
or none, so a full queue refuses the whole request and leaves nothing half-queued."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from runtime.engine import Engine, QueueFull, RequestHandle
from runtime.types import Finished, FinishReason, GenerationRequest, GenerationStats, TextDelta


class GatedRunner:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.order: list[int] = []

    def run(self, handle: RequestHandle) -> Finished:
        self.gate.wait(10)
        self.order.append(handle.request.prompt_tokens[0])
        handle.emit(TextDelta("x", (1,)))
        return Finished(FinishReason.LENGTH, GenerationStats(1, 1))


@pytest.fixture
def engine() -> Iterator[tuple[Engine, GatedRunner]]:
    runner = GatedRunner()
    eng = Engine(runner, max_queue=3)
    eng.start()
    yield eng, runner
    runner.gate.set()
    eng.stop()


def _req(token: int) -> GenerationRequest:
    return GenerationRequest((token,), 1)


def test_submit_all_is_all_or_nothing(engine: tuple[Engine, GatedRunner]) -> None:
    eng, runner = engine
    assert eng.capacity == 3
    first = eng.submit(_req(0))
    while eng.queue_depth > 0:  # until the worker took it (it waits at the gate)
        threading.Event().wait(0.001)
    eng.submit(_req(1))
    with pytest.raises(QueueFull, match="3 generations asked, 2 of 3"):
        eng.submit_all([_req(2), _req(3), _req(4)])
    assert eng.queue_depth == 1  # nothing of the refused group was queued
    group = eng.submit_all([_req(5), _req(6)])
    assert eng.queue_depth == 3
    runner.gate.set()
    for handle in [first, *group]:
        assert [type(e) for e in handle][-1] is Finished
    assert runner.order == [0, 1, 5, 6]
