"""The engine's vocabulary (runtime/engine/engine.py re-exports all of it): its errors, its
states, its health and counters, and the two kinds of runner it drives."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from runtime.batch import RequestHandle
from runtime.types import Finished, FinishReason


class QueueFull(Exception):
    """The engine's request queue is at capacity; retry later."""


class EngineStopped(Exception):
    """The engine is not running."""


class EngineState(str, Enum):
    STOPPED = "stopped"
    RUNNING = "running"
    DRAINING = "draining"  # new requests refused; the queued and running ones go on
    FAILED = "failed"  # the worker died; a fresh one starts after a delay
    STALLED = "stalled"  # the worker stopped stepping; a fresh one starts when it returns


class EngineUnavailable(EngineStopped):
    """The engine is started but takes no requests now (see `state`)."""

    def __init__(self, message: str, state: EngineState) -> None:
        super().__init__(message)
        self.state = state


class EngineFailure(Finished):
    """How a request ends when the engine failed under it (its worker died or stalled):
    not the request's fault, so worth retrying once the engine has restarted."""


@dataclass(frozen=True)
class EngineHealth:
    state: EngineState
    heartbeat_age: float | None  # seconds since the worker last stepped, admitted or polled
    busy: bool
    restarts: int  # fresh workers started after a failure or a stall
    failures: int  # worker deaths and stalls
    last_failure: str | None


@dataclass
class EngineStats:
    """Counters the worker updates; read them for /health and metrics."""

    requests_total: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    busy: bool = False
    # the running batch, for a BatchRunner (sequences decoding, prompts being read,
    # decode steps taken and their running average duration)
    running: int = 0
    prefilling: int = 0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0


class Heartbeat:
    """The worker's last sign of life and its failure record: the worker beats, the
    watchdog (runtime/engine/watchdog.py) records failures, /health reads both."""

    def __init__(self) -> None:
        self.at = time.monotonic()  # the worker's last step, admission or idle poll
        self.streak = 0  # failures since a request last finished well
        self.restarts = 0  # fresh workers started after a failure or a stall
        self.failures = 0  # worker deaths and stalls
        self.last_failure: str | None = None

    def beat(self) -> None:
        self.at = time.monotonic()

    def age(self) -> float:
        return max(0.0, time.monotonic() - self.at)

    def worked(self) -> None:
        """A request finished well: the engine works, the next failure restarts it quickly."""
        self.streak = 0

    def failed(self, error: str) -> None:
        self.failures += 1
        self.streak += 1
        self.last_failure = error


class Runner(Protocol):
    """Serves one request from start to finish."""

    def run(self, handle: RequestHandle) -> Finished: ...


class BatchRunner(Protocol):
    """Serves many requests at once (runtime.engine.runner.ModelRunner): `admit` takes one in
    (raising if it cannot run), `step` advances them all and returns those that ended."""

    @property
    def idle(self) -> bool: ...
    def has_room(self) -> bool: ...
    def admit(self, handle: RequestHandle) -> None: ...
    def step(self) -> list[tuple[RequestHandle, Finished]]: ...
    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]: ...
    def load(self) -> tuple[int, int, int, float]:
        """(running, prefilling, decode steps taken, average decode step seconds)."""
        ...
