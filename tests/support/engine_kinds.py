"""Tiny random models of each cache kind, written as folders the engine loads: the
scheduler's and the disk tier's engine tests run every kind through the real loader.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``: the model
builders import both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tests.support.tiny_deepseek as tiny_deepseek
import tests.support.tiny_hybrid as tiny_hybrid
import tests.support.tiny_models as tiny_models
from runtime.batch.handle import RequestHandle
from runtime.engine import Engine
from runtime.types import Finished, GenerationRequest, TextDelta

# name -> (module that builds it, vocabulary size)
KINDS: dict[str, tuple[Any, int]] = {
    "llama": (tiny_models, tiny_models.VOCAB),  # KV
    "gemma3_text": (tiny_models, tiny_models.VOCAB),  # sliding window + KV
    "qwen3_next": (tiny_hybrid, tiny_hybrid.VOCAB),  # recurrent + KV
    "deepseek_v3": (tiny_deepseek, tiny_deepseek.VOCAB),  # MLA latents
}


def folder_maker(
    tmp_path_factory: pytest.TempPathFactory, kinds: dict[str, tuple[Any, int]] = KINDS
) -> Callable[[str], Path]:
    """name (of `kinds`) -> the folder of that kind's tiny model, each written once."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            module, vocab = kinds[name]
            folder = tmp_path_factory.mktemp(name)
            module.make_tiny(name, folder, seed=3)
            tiny_models.write_tokenizer(folder, vocab)
            made[name] = folder
        return made[name]

    return get


def prompt(n: int, seed: int, vocab: int) -> tuple[int, ...]:
    """n random token ids above the special ones."""
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(3, vocab, size=n))


def collect(handle: RequestHandle) -> tuple[list[int], Finished]:
    """A request's token ids and its Finished event, read to the end."""
    tokens: list[int] = []
    for event in handle:
        if isinstance(event, TextDelta):
            tokens.extend(event.token_ids)
        else:
            assert isinstance(event, Finished)
            return tokens, event
    raise AssertionError("no Finished event")


def together(
    engine: Engine, requests: Sequence[GenerationRequest], delays: Sequence[float] = ()
) -> list[tuple[list[int], Finished]]:
    """Submit from one thread each (after its delay), all running at once."""
    results: list[Any] = [None] * len(requests)

    def client(i: int) -> None:
        time.sleep(delays[i] if delays else 0.0)
        results[i] = collect(engine.submit(requests[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results)
    return results
