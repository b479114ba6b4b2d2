"""Turns on the cores (runtime/engine/turns.py): while a chat engine has work, an encoder's
slices run only in turns it hands over between its steps, never beside a step, and paced
so the chat engine keeps its share; without one they run at once. Shown by the order of
events (and, for the pacing, a clock the test moves), never by timing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from runtime.engine import Turn, Turns

CHAT = "chat"


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, event: str) -> None:
        with self._lock:
            self.events.append(event)


class Chat(threading.Thread):
    """A chat engine's worker: steps, busy until `stop` is set (then one last step)."""

    def __init__(self, turns: Turns, log: Log, step: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.turns, self.log, self.step = turns, log, step
        self.started, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        while True:
            last = self.stop.is_set()
            self.turns.before_step(CHAT, lambda: self.log("sync"))
            self.log("step")
            self.step()
            self.turns.after_step(CHAT, busy=not last)
            self.started.set()
            if last:
                return

    def __enter__(self) -> Chat:
        self.start()
        assert self.started.wait(60)  # the chat engine is busy before the encoder starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(60)


def _slices(turns: Turns, log: Log, count: int, work: Callable[[], None] = lambda: None) -> None:
    """An encoder's worker: `count` slices."""
    for _ in range(count):
        with turns.background() as turn:
            log("start" if turn.contended else "start free")
            work()
            log("end")


def _between(events: list[str]) -> list[list[str]]:
    """The events between consecutive contended slices."""
    out: list[list[str]] = []
    current: list[str] | None = None
    for event in events:
        if event == "start":
            if current is not None:
                out.append(current)
            current = []
        elif current is not None and event not in ("end", "start free"):
            current.append(event)
    return out


def test_slices_run_between_chat_steps_never_beside_them() -> None:
    turns = Turns(patience_s=600.0)  # the test waits for events, never for a turn's patience
    log = Log()
    with Chat(turns, log):
        _slices(turns, log, 20)
    events = log.events
    starts = [i for i, e in enumerate(events) if e.startswith("start")]
    assert len(starts) == 20
    for i in starts:  # nothing of the chat engine's inside a slice
        assert events[i + 1] == "end", events[i : i + 3]
    contended = [i for i in starts if events[i] == "start"]
    assert len(contended) == 20
    for gap in _between(events):
        assert "step" in gap  # a chat step between any two slices
    for i in contended:  # each turn handed over after the chat's queued work finished
        assert events[i - 1] == "sync"
    assert turns.handoffs == len(contended)


def test_without_chat_work_slices_never_wait() -> None:
    turns = Turns(patience_s=600.0)
    log = Log()
    with Chat(turns, log) as chat:
        chat.stop.set()  # its next step is its last
    _slices(turns, log, 5)
    log.events = [e for e in log.events if e != "step"]
    assert log.events == ["start free", "end"] * 5
    assert turns.handoffs == 0 and turns.slice_seconds() is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> Callable[[], None]:
        def move() -> None:
            self.now += seconds

        return move


def test_a_long_slice_is_repaid_by_the_steps_after_it() -> None:
    """Slices 8 steps long, the encoder's share 1/2: each step earns it a step's time, so
    after a slice the chat engine steps 8 times before the next: it keeps its share
    whatever the slices' length. (The test's clock moves by binary fractions: exact.)"""
    clock = Clock()
    turns = Turns(share=0.5, grain_s=0.0, patience_s=600.0, clock=clock)
    log = Log()
    step = 2.0**-6
    with Chat(turns, log, clock.advance(step)):
        assert turns.slice_seconds() == step  # what fits one step's credit
        _slices(turns, log, 6, clock.advance(8 * step))
    gaps = _between(log.events)
    assert [gap.count("step") for gap in gaps] == [8] * 5
    assert turns.slice_seconds() is None  # the chat engine ended idle


def test_short_steps_pool_their_credit_into_one_slice() -> None:
    """Steps earning a quarter of the grain each: a turn every 4 steps, a grain long."""
    clock = Clock()
    step = 2.0**-6
    turns = Turns(share=0.5, grain_s=4 * step, patience_s=600.0, clock=clock)
    log = Log()
    with Chat(turns, log, clock.advance(step)):
        assert turns.slice_seconds() == 4 * step
        _slices(turns, log, 6, clock.advance(4 * step))
    assert [gap.count("step") for gap in _between(log.events)] == [4] * 5


def test_a_slice_waits_no_longer_than_its_patience() -> None:
    """A chat engine busy but no longer stepping (stuck) never blocks an encoder for good."""
    turns = Turns(patience_s=0.01)
    turns.before_step(CHAT, lambda: None)
    turns.after_step(CHAT, busy=True)
    with turns.background() as turn:
        assert turn.contended
    assert turns.handoffs == 0
    turns.leave(CHAT)
    with turns.background() as turn:
        assert not turn.contended


# -- the engines ------------------------------------------------------------------------

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.engine import (  # noqa: E402
    EncoderRunner,
    EncoderSettings,
    Engine,
    ModelRunner,
    RunnerSettings,
)
from runtime.load import LoadedEncoder, load, load_encoder  # noqa: E402
from runtime.text import EncoderTokenizer  # noqa: E402
from runtime.types import (  # noqa: E402
    Encoded,
    EncodeInput,
    EncodeRequest,
    GenerationRequest,
    SamplingParams,
    TextDelta,
)
from tests.support.engine_kinds import folder_maker  # noqa: E402
from tests.support.tiny_encoders import WORDS, save_encoder  # noqa: E402


class RecordingTurns(Turns):
    """Turns that log each chat step and each encoder slice."""

    def __init__(self, log: Log) -> None:
        super().__init__(grain_s=0.0, patience_s=600.0)  # a turn at every step with credit
        self.log = log

    def before_step(self, member: object, sync: Callable[[], None]) -> None:
        super().before_step(member, sync)
        self.log("step")

    @contextmanager
    def background(self) -> Iterator[Turn]:
        with super().background() as turn:
            self.log("start" if turn.contended else "start free")
            yield turn
            self.log("end")


@pytest.fixture(scope="module")
def encoder_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedEncoder:
    folder = tmp_path_factory.mktemp("tiny-bert-turns")
    save_encoder(folder, "bert")
    return load_encoder(folder)


def _inputs(loaded: LoadedEncoder, count: int) -> list[EncodeInput]:
    rng = np.random.default_rng(7)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(count)]
    return [t.input for t in EncoderTokenizer(loaded.tokenizer).texts(texts, loaded.max_length)]


def test_engines_take_turns(
    encoder_model: LoadedEncoder, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A chat stream and a 300-input encode on two engines sharing the server's turns:
    while the stream runs, the encoder computes a layer at a time, each in a turn between
    two chat steps, none beside one."""
    log = Log()
    turns = RecordingTurns(log)
    chat_folder: Path = folder_maker(tmp_path_factory)("llama")
    chat = Engine(ModelRunner(load(chat_folder), RunnerSettings(prefix_cache_bytes=0)))
    encoder = EncoderRunner(encoder_model, EncoderSettings(piece_tokens=128, cache_entries=0))
    engine = Engine(encoder)
    for e in (chat, engine):
        e.take_turns(turns)
        e.start()
    try:
        no_eos = SamplingParams(temperature=0.0, logit_bias={2: -100.0})
        stream = chat.submit(GenerationRequest((5, 6, 7), 100_000, no_eos))
        first = next(e for e in stream if isinstance(e, TextDelta) and e.token_ids)
        assert first.token_ids
        *_, done = list(engine.submit(EncodeRequest.of(tuple(_inputs(encoder_model, 300)))))
        stream.cancel()
        assert isinstance(done, Encoded)
    finally:
        engine.stop()
        chat.stop()
    events = log.events
    starts = [i for i, e in enumerate(events) if e.startswith("start")]
    for i in starts:
        assert events[i + 1] == "end"  # no chat step began inside a slice
    assert len(starts) == 2 * encoder.pieces  # the tiny model's two layers: a slice each
    contended = [e for e in events if e == "start"]
    assert len(contended) >= 2
    for gap in _between(events)[: len(contended) - 1]:
        assert "step" in gap
    assert turns.handoffs >= len(contended) - 1
