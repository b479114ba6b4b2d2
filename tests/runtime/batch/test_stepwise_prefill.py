"""A long prompt chunk goes through a plain stack's layers a piece at a time
(`LayerStack.stepwise`, runtime/batch/prompt_prefill.py `stepwise_forward`): the same
hidden states and caches, bit for bit, as the chunk's forward evaluated as one graph."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.batch import prompt_prefill
from runtime.batch.prompt_prefill import STEPWISE_TOKENS, PromptPrefill
from runtime.cache import LayerCache
from runtime.models.decoder import LayerStack
from runtime.prefix.cache import PrefixCache
from tests.support.model_checks import TinyModels, random_tokens
from tests.support.tiny_hybrid import make_tiny as make_hybrid
from tests.support.tiny_models import load_mlx
from tests.support.tiny_models import make_tiny as make_dense

BIG = 10**9


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_dense)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_hybrid)


def _states(caches: list[Any]) -> list[mx.array]:
    return [a for c in caches for a in c.state]


def _same(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(bool(mx.array_equal(x, y)) for x, y in zip(a, b, strict=True))


def _check_stepwise(model: Any, vocab: int) -> None:
    body = model.model
    assert isinstance(body, LayerStack)
    tokens = mx.array(random_tokens(vocab, 300, seed=3))
    for split in (40, 300):  # a first chunk, then one over keys it did not write
        whole, pieces = model.make_caches(), model.make_caches()
        if split < 300:
            for caches in (whole, pieces):
                mx.eval(body(tokens[:, :split], caches), _states(caches))
        rest = tokens[:, split:] if split < 300 else tokens
        expected = body(rest, whole)
        mx.eval(expected, _states(whole))
        got = body.stepwise(rest, pieces)
        mx.eval(got, _states(pieces))
        assert bool(mx.array_equal(got, expected))
        assert _same(_states(pieces), _states(whole))
        assert [c.offset for c in pieces] == [c.offset for c in whole]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_stepwise_equals_one_graph(name: str, dense: TinyModels) -> None:
    model = load_mlx(dense[name][1])
    _check_stepwise(model, model.args.vocab_size)


@pytest.mark.parametrize("name", ["qwen3_next"])
def test_stepwise_takes_other_layers_whole(name: str, hybrid: TinyModels) -> None:
    # a hybrid's layers are no PreNormBlock: each is one piece
    model = load_mlx(hybrid[name][1])
    _check_stepwise(model, model.args.vocab_size)


def _prefill(model: Any, prompt: list[int], chunk: int) -> list[mx.array]:
    pc: PrefixCache[LayerCache] = PrefixCache(model.make_caches, budget_bytes=BIG)
    lease = pc.begin(prompt)
    reading = PromptPrefill(lease, prompt)
    while not reading.done:
        reading.run(model, chunk, lambda at: None)
    out = _states(lease.caches)
    mx.eval(out)
    pc.discard(lease)
    return out


def test_a_long_chunk_goes_stepwise(dense: TinyModels, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_mlx(dense["qwen2"][1])
    prompt = [int(t) for t in random_tokens(model.args.vocab_size, 700, seed=4)[0]]
    calls: list[int] = []
    stepwise = LayerStack.stepwise

    def counted(self: LayerStack, tokens: mx.array, caches: Any) -> mx.array:
        calls.append(tokens.shape[1])
        return stepwise(self, tokens, caches)

    monkeypatch.setattr(LayerStack, "stepwise", counted)
    got = _prefill(model, prompt, 500)
    assert calls == [500]  # the 199-token rest is below STEPWISE_TOKENS: one graph
    assert 199 < STEPWISE_TOKENS <= 500
    monkeypatch.setattr(prompt_prefill, "STEPWISE_TOKENS", BIG)
    assert _same(got, _prefill(model, prompt, 500))
    assert calls == [500]
