"""A served model whose engine writes scripted text (SmolLM2's tokenizer and template,
no model run), and a stand-in that holds a call through it until a test says.

For tests of what happens around generation (admission, refusals, limits): cheap to
start, and every answer is known.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.core.models.build import build_served
from gateway.core.models.served import ServedModel
from runtime.engine import Engine, RequestHandle
from runtime.types import Finished, FinishReason, GenerationStats, TextDelta

HANG_S = 120.0  # only a hang waits this long


class ScriptRunner:
    """Stands in for the model: writes `text` until max_tokens."""

    text = "zebra "

    def run(self, handle: RequestHandle) -> Finished:
        prompt = len(handle.request.prompt_tokens)
        n = 0
        for n in range(handle.request.max_tokens):
            if handle.cancelled:
                return Finished(FinishReason.CANCELLED, GenerationStats(prompt, n))
            handle.emit(TextDelta(self.text, (n,)))
        return Finished(FinishReason.LENGTH, GenerationStats(prompt, n + 1))


def scripted_served(
    path: Path,
    model_id: str,
    *,
    runner: ScriptRunner | None = None,
    max_queue: int = 8,
    **replace: Any,
) -> ServedModel:
    """The model at `path` (its tokenizer and template) behind a scripted engine;
    `replace` sets other fields of the ServedModel (a renderer, an image policy)."""
    served = build_served(path, model_id=model_id)
    engine = Engine(runner or ScriptRunner(), max_queue=max_queue)
    return dataclasses.replace(served, engine=engine, runner=None, **replace)


class HoldNextCall:
    """Stands in for `inner`: once `arm()`ed, the next call of any of its methods sets
    `entered` and waits for `release` (the test's gate); other calls go straight through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self._hold()
            return value(*args, **kwargs)

        return call

    def _hold(self) -> None:
        with self._lock:
            held, self._armed = self._armed, False
        if held:
            self.entered.set()
            self.release.wait(HANG_S)


def wait_for(event: threading.Event, what: str) -> None:
    assert event.wait(HANG_S), f"timed out waiting for {what}"


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """`work()` on a thread of its own; its result lands in the returned list."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    return thread, out
