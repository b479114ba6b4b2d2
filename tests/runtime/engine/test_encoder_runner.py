"""The encoder runner behind an Engine (a tiny random BERT): a long request runs in
pieces whose rows equal one forward's, identical inputs are computed once (the LRU of
recent rows, and inputs still waiting), cancellation and refusals end requests cleanly,
and a 1,000-input request never stalls a chat model's running stream."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.batch import open_handle
from runtime.engine import (
    EncoderRunner,
    EncoderSettings,
    Engine,
    ModelRunner,
    RequestHandle,
    RunnerSettings,
)
from runtime.load import LoadedEncoder, load, load_encoder
from runtime.text import EncoderTokenizer
from runtime.types import (
    Encoded,
    EncodeInput,
    EncodeRequest,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TextDelta,
)
from tests.support.engine_kinds import folder_maker
from tests.support.tiny_encoders import WORDS, run_encoder, save_encoder


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedEncoder:
    folder = tmp_path_factory.mktemp("tiny-bert")
    save_encoder(folder, "bert")
    return load_encoder(folder)


def _inputs(loaded: LoadedEncoder, count: int, seed: int = 0) -> list[EncodeInput]:
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(count)]
    return [t.input for t in EncoderTokenizer(loaded.tokenizer).texts(texts, loaded.max_length)]


def _engine(runner: EncoderRunner) -> Iterator[Engine]:
    engine = Engine(runner)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def runner(loaded: LoadedEncoder) -> EncoderRunner:
    return EncoderRunner(loaded, EncoderSettings(piece_tokens=256, cache_entries=64))


@pytest.fixture
def engine(runner: EncoderRunner) -> Iterator[Engine]:
    yield from _engine(runner)


def _finish(engine: Engine, inputs: list[EncodeInput]) -> Finished:
    *_, done = list(engine.submit(EncodeRequest.of(tuple(inputs))))
    assert isinstance(done, Finished)
    return done


def test_pieces_equal_one_forward(
    loaded: LoadedEncoder, engine: Engine, runner: EncoderRunner
) -> None:
    inputs = _inputs(loaded, 60)
    done = _finish(engine, inputs)
    assert isinstance(done, Encoded) and done.values is not None
    assert runner.pieces > 3  # 60 inputs of up to ~45 tokens in 256-token pieces
    whole = run_encoder(loaded, inputs, piece_tokens=1 << 20)
    np.testing.assert_allclose(done.values, whole, atol=1e-5, rtol=0)
    assert done.stats.prompt_tokens == sum(len(x.tokens) for x in inputs)


def test_identical_inputs_are_computed_once(
    loaded: LoadedEncoder, engine: Engine, runner: EncoderRunner
) -> None:
    inputs = _inputs(loaded, 5, seed=1)
    first = _finish(engine, inputs * 3)  # each input three times in one request
    assert runner.rows_computed == 5 and runner.rows_reused == 10
    assert isinstance(first, Encoded) and first.values is not None
    np.testing.assert_array_equal(first.values[:5], first.values[5:10])
    again = _finish(engine, inputs[::-1])  # all five from the LRU of recent rows
    assert runner.rows_computed == 5
    assert isinstance(again, Encoded) and again.values is not None
    np.testing.assert_array_equal(again.values, first.values[:5][::-1])
    assert again.stats.cached_tokens == again.stats.prompt_tokens > 0


def test_lru_keeps_the_most_recent(loaded: LoadedEncoder) -> None:
    runner = EncoderRunner(loaded, EncoderSettings(cache_entries=4))
    for engine in _engine(runner):
        inputs = _inputs(loaded, 6, seed=2)
        _finish(engine, inputs)
        _finish(engine, inputs[-4:])  # the last four are kept
        assert runner.rows_computed == 6
        _finish(engine, inputs[:1])  # the first was evicted
        assert runner.rows_computed == 7


def test_refusals_end_the_request_not_the_engine(loaded: LoadedEncoder, engine: Engine) -> None:
    done = _finish(engine, [EncodeInput(tuple(range(5, 5 + loaded.max_length + 1)))])
    assert done.reason is FinishReason.ERROR and "takes" in (done.error or "")
    done = _finish(engine, [EncodeInput((1, loaded.model.args.vocab_size))])
    assert done.reason is FinishReason.ERROR and "token id" in (done.error or "")
    *_, generated = list(engine.submit(GenerationRequest((5, 6), 4)))
    assert isinstance(generated, Finished) and generated.reason is FinishReason.ERROR
    assert "generates no text" in (generated.error or "")
    assert isinstance(_finish(engine, _inputs(loaded, 2)), Encoded)  # still serving


def test_cancelled_request_is_dropped(loaded: LoadedEncoder, runner: EncoderRunner) -> None:
    handle = open_handle(EncodeRequest.of(tuple(_inputs(loaded, 40, seed=4))))
    runner.admit(handle)
    handle.cancel()
    ended = runner.step()
    assert [(h, d.reason) for h, d in ended] == [(handle, FinishReason.CANCELLED)]
    assert runner.idle and runner.step() == [] and runner.pieces == 0


def _read(
    stream: RequestHandle, encoder: EncoderRunner, seen: list[int], first: threading.Event
) -> None:
    """Read a chat stream, noting at each token how many pieces the encoder has run."""
    for event in stream:
        if isinstance(event, TextDelta) and event.token_ids:
            seen.append(encoder.pieces)
            first.set()


def test_a_long_encode_never_stalls_a_chat_stream(
    loaded: LoadedEncoder, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A chat model streams on its own engine while a 1,000-input request runs on the
    encoder's in pieces: chat tokens arrive between the encode's pieces, before it ends."""
    chat_folder: Path = folder_maker(tmp_path_factory)("llama")
    chat = Engine(ModelRunner(load(chat_folder), RunnerSettings(prefix_cache_bytes=0)))
    encoder = EncoderRunner(loaded, EncoderSettings(piece_tokens=128, cache_entries=0))
    chat.start()
    try:
        for engine in _engine(encoder):
            no_eos = SamplingParams(temperature=0.0, logit_bias={2: -100.0})
            stream = chat.submit(GenerationRequest((5, 6, 7), 400, no_eos))
            seen: list[int] = []  # the encoder's pieces so far, at each chat token
            first_token = threading.Event()
            reader = threading.Thread(target=_read, args=(stream, encoder, seen, first_token))
            reader.start()
            assert first_token.wait(60)  # the stream runs before the encode is sent
            done = _finish(engine, _inputs(loaded, 1000, seed=5))
            pieces = encoder.pieces
            stream.cancel()
            reader.join(60)
            assert isinstance(done, Encoded) and pieces >= 50
            during = [p for p in seen if 0 < p < pieces]
            assert len(set(during)) >= 2, (pieces, seen[-10:])  # tokens between pieces
    finally:
        chat.stop()


def test_each_request_logs_one_line(
    loaded: LoadedEncoder, caplog: pytest.LogCaptureFixture
) -> None:
    inputs = _inputs(loaded, 7, seed=6)
    with caplog.at_level(logging.DEBUG, logger="runtime.engine.encoder"):
        run_encoder(loaded, inputs)
    lines = [r.getMessage() for r in caplog.records if r.name == "runtime.engine.encoder"]
    tokens = sum(len(x.tokens) for x in inputs)
    assert len(lines) == 1 and f"inputs=7 tokens={tokens} cached=0" in lines[0], lines
