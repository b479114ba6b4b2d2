"""Harness shared by the architecture tests (tests/test_models*.py): tiny models built on
first use, random prompts, and running a model over tokens with caches, whole or chunked."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime.models import LanguageModel


class TinyModels(dict[str, tuple[Any, Path]]):
    """name -> (torch model, saved folder), each built on first use by `make(name, folder)`."""

    def __init__(self, factory: pytest.TempPathFactory, make: Callable[[str, Path], Any]) -> None:
        super().__init__()
        self._factory = factory
        self._make = make

    def __missing__(self, name: str) -> tuple[Any, Path]:
        directory = self._factory.mktemp(name)
        self[name] = (self._make(name, directory), directory)
        return self[name]


def random_tokens(vocab: int, n: int, seed: int = 1, batch: int = 1) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, n)).astype(np.int32)


def forward(model: LanguageModel, tokens: np.ndarray[Any, Any], caches: Sequence[Any]) -> Any:
    """One forward pass over `tokens`, caches advanced and evaluated; the logits as numpy."""
    out = model(mx.array(tokens), caches)
    mx.eval(out, *[a for c in caches for a in c.state])
    return np.array(out)


def chunked(
    model: LanguageModel,
    tokens: np.ndarray[Any, Any],
    sizes: Sequence[int],
    caches: Sequence[Any] | None = None,
) -> Any:
    """Feed `tokens` in chunks of the given sizes (the last repeats); return all logits.
    Without `caches`, fresh ones, which must have counted every token at the end."""
    fresh = caches is None
    use = model.make_caches() if caches is None else caches
    outs, start, i = [], 0, 0
    while start < tokens.shape[1]:
        size = sizes[min(i, len(sizes) - 1)]
        outs.append(forward(model, tokens[:, start : start + size], use))
        start, i = start + size, i + 1
    if fresh:
        assert all(c.offset == tokens.shape[1] for c in use)
    return np.concatenate(outs, axis=1)


def assert_matches_transformers(
    hf: Any, directory: Path, tokens: np.ndarray[Any, Any], atol: float
) -> None:
    """Our model loaded from the saved folder gives transformers' logits for `tokens`."""
    from tests.support.tiny_models import load_mlx, torch_logits

    model = load_mlx(directory)
    ours = forward(model, tokens, model.make_caches())
    np.testing.assert_allclose(ours, torch_logits(hf, tokens), atol=atol, rtol=0)


def assert_chunked_prefill_then_decode(
    model: LanguageModel, tokens: np.ndarray[Any, Any], prompt: int, chunk: int, atol: float
) -> None:
    """The first `prompt` tokens prefilled in chunks of `chunk`, then the rest decoded one
    at a time, give the logits of a one-shot prefill followed by the same decode."""
    head, follow = tokens[:, :prompt], tokens[:, prompt:]
    one_shot = model.make_caches()
    ref_last = forward(model, head, one_shot)[:, -1]
    ref_decode = [forward(model, follow[:, i : i + 1], one_shot) for i in range(follow.shape[1])]

    caches = model.make_caches()
    last = chunked(model, head, [chunk], caches)[:, -1]
    np.testing.assert_allclose(last, ref_last, atol=atol, rtol=0)
    for i, ref in enumerate(ref_decode):
        np.testing.assert_allclose(forward(model, follow[:, i : i + 1], caches), ref, atol=atol)
    assert all(c.offset == tokens.shape[1] for c in caches)


def assert_step_decode_matches_full(
    model: LanguageModel, tokens: np.ndarray[Any, Any], atol: float
) -> None:
    """A 5-token prefill then one token at a time gives the logits of one full pass."""
    full = forward(model, tokens, model.make_caches())
    steps = chunked(model, tokens, [5, 1], model.make_caches())
    np.testing.assert_allclose(steps, full, atol=atol, rtol=0)
