"""`--kv-bits` through the model and the engine (runtime/cache/quantized.py).

Oracles: the same model over float caches whose keys and values were quantized and
dequantized on the way in (the quantized cache must compute exactly that, up to float32
summation order), the float cache itself within a stated tolerance, and, with greedy
decoding, the engine's invariant: the same tokens with the prefix cache and batching on
as with both off, on quantized caches too (whose state never depends on chunking).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.cache import KVCache, QuantizedKVCache, quantizing
from runtime.engine import Engine
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.types import FinishReason, GenerationRequest, SamplingParams, TextDelta
from tests.support.engine_kinds import KINDS as ENGINE_KINDS
from tests.support.engine_kinds import collect, folder_maker, prompt

# the largest logit difference from the float cache, as a share of the largest logit
# (measured on the tiny models: 0.7-1.3% at 8 bits, 21-23% at 4)
TOLERANCE = {8: 0.03, 4: 0.5}
# ...and from the float cache holding quantized-then-dequantized keys and values: float32
# summation order only (measured under 1e-6), except where a difference that small
# flips one 4-bit rounding in a later layer, a step of 1/15 of a group's range (3% seen)
ROUND_TRIP = {8: 1e-4, 4: 0.05}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return folder_maker(tmp_path_factory)


class _RoundTrip(KVCache):
    """A float cache that stores what quantizing then dequantizing gives (keys in the
    Hadamard basis at 8 bits, head_dims padded to 32, groups of 64 at 8 bits and 32 at
    4): the
    oracle of what a quantized cache's attention sees."""

    def __init__(self, bits: int) -> None:
        super().__init__()
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        rotated = self.bits == 8  # keys in the Hadamard basis at 8 bits
        return super().update_and_fetch(self._round(keys, rotated), self._round(values, False))

    def _round(self, x: mx.array, rotated: bool) -> mx.array:
        dim = x.shape[-1]
        width = -(-dim // 32) * 32
        if width != dim:
            x = mx.pad(x, [(0, 0)] * 3 + [(0, width - dim)])
        if rotated:  # widths 32 and 64 here: one Hadamard block
            x = mx.hadamard_transform(x, scale=width**-0.5)
        group = 64 if self.bits == 8 and width % 64 == 0 else 32
        parts = mx.quantize(x, group_size=group, bits=self.bits)
        out = mx.dequantize(*parts, group_size=group, bits=self.bits)
        if rotated:
            out = mx.hadamard_transform(out, scale=width**-0.5)
        return out[..., :dim]


def _logits(model: Any, caches: Sequence[Any], tokens: Sequence[int]) -> mx.array:
    """A prompt in three chunks (the last long enough for the CPU kernel), then decode
    steps: every path through the attention."""
    out = []
    for start, end in ((0, 20), (20, 21), (21, 60), *((i, i + 1) for i in range(60, 64))):
        out.append(model(mx.array([tokens[start:end]]), caches))
    return mx.concatenate(out, axis=1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_tiny_model_reads_its_quantized_cache_exactly(
    name: str, bits: int, folders: Callable[[str], Path]
) -> None:
    """llama's head_dim is 32; qwen3_next's attention layers (beside its recurrent ones)
    have 16, quantized padded to 32."""
    model = load(folders(name)).model
    vocab = ENGINE_KINDS[name][1]
    tokens = prompt(64, 5, vocab)
    base = model.make_caches()
    float_logits = _logits(model, base, tokens)
    caches = quantizing(model.make_caches, bits)()
    assert any(isinstance(c, QuantizedKVCache) for c in caches)
    got = _logits(model, caches, tokens)
    oracle = [_RoundTrip(bits) if type(c) is KVCache else c for c in model.make_caches()]
    want = _logits(model, oracle, tokens)
    scale = float(mx.abs(float_logits).max())
    assert float(mx.abs(got - want).max()) <= ROUND_TRIP[bits] * scale
    assert float(mx.abs(got - float_logits).max()) <= TOLERANCE[bits] * scale


def _request(tokens: Sequence[int], new: int) -> GenerationRequest:
    return GenerationRequest(tuple(tokens), new, SamplingParams(temperature=0.0), prefill_chunk=16)


def _engine(folder: Path, *, max_batch: int, cache: bool, bits: int | None) -> Engine:
    settings = RunnerSettings(
        prefill_chunk=16,
        max_batch=max_batch,
        prefix_cache_bytes=256 * 1024**2 if cache else 0,
        snapshot_interval=8,
        cache_memory_bytes=1 << 30,
        kv_bits=bits,
    )
    engine = Engine(ModelRunner(load(folder), settings), max_queue=64)
    engine.start()
    return engine


def _run(engine: Engine, requests: Sequence[GenerationRequest]) -> list[list[int]]:
    """All at once (submitted together, read in turn)."""
    return [tokens for tokens, _ in _run_cached(engine, requests)]


def _run_cached(
    engine: Engine, requests: Sequence[GenerationRequest]
) -> list[tuple[list[int], int]]:
    """`_run`, with the prompt tokens each request took from the prefix cache."""
    handles = [engine.submit(r) for r in requests]
    out = []
    for handle in handles:
        tokens, done = collect(handle)
        assert done.error is None and done.reason in (FinishReason.LENGTH, FinishReason.STOP)
        out.append((tokens, done.stats.cached_tokens))
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "deepseek_v3"])
def test_greedy_tokens_with_the_cache_on_equal_those_with_it_off(
    name: str, folders: Callable[[str], Path]
) -> None:
    """8-bit caches: requests alone (no batching, no prefix cache) against the same
    requests together with the prefix cache on, twice (the second round from the trie).
    deepseek_v3's latent (MLA) caches stay as they are."""
    folder, vocab = folders(name), ENGINE_KINDS[name][1]
    shared = prompt(40, 11, vocab)
    requests = [
        _request(prompt(7, 1, vocab), 12),
        _request(shared + prompt(5, 3, vocab), 9),
        _request(shared + prompt(9, 4, vocab), 15),
        _request(prompt(1, 5, vocab), 6),
        _request(prompt(23, 6, vocab), 17),
    ]
    alone_engine = _engine(folder, max_batch=1, cache=False, bits=8)
    try:
        alone = [_run(alone_engine, [r])[0] for r in requests]
    finally:
        alone_engine.stop()
    engine = _engine(folder, max_batch=8, cache=True, bits=8)
    runner = engine._runner
    assert isinstance(runner, ModelRunner)
    try:
        first = _run(engine, requests)
        again = _run_cached(engine, requests)
    finally:
        engine.stop()
    assert first == alone and [t for t, _ in again] == alone
    assert runner.scheduler.stats.max_batch_seen > 1
    assert all(cached > 0 for _, cached in again[:3])  # the trie had their prompts
    quantized = any(isinstance(c, QuantizedKVCache) for c in runner.make_caches())
    assert quantized == (name != "deepseek_v3")


@pytest.mark.parametrize("mode", ["fused", "layered"])
def test_prompts_read_while_others_decode_give_the_same_tokens(
    mode: str, folders: Callable[[str], Path]
) -> None:
    """Prompts arriving while 8-bit rows decode ride in the decode steps' forwards, or go
    a few layers per step (the CPU's way), and still get their tokens alone."""
    folder, vocab = folders("llama"), ENGINE_KINDS["llama"][1]
    running = [_request(prompt(5, 40 + i, vocab), 150) for i in range(2)]
    arriving = [_request(prompt(45, 50 + i, vocab), 10) for i in range(3)]
    alone_engine = _engine(folder, max_batch=1, cache=False, bits=8)
    try:
        expected = [_run(alone_engine, [r])[0] for r in [*running, *arriving]]
    finally:
        alone_engine.stop()
    engine = _engine(folder, max_batch=8, cache=True, bits=8)
    runner = engine._runner
    assert isinstance(runner, ModelRunner)
    scheduler = runner.scheduler
    scheduler.layered = mode == "layered"
    if mode == "layered":
        scheduler._layer_pace.min_prompt = 0
    try:
        first = [engine.submit(r) for r in running]
        heads = [next(e for e in h if isinstance(e, TextDelta)).token_ids for h in first]
        later = _run(engine, arriving)
        rest = [collect(h)[0] for h in first]
        stats = scheduler.stats
    finally:
        engine.stop()
    assert (stats.layered_steps if mode == "layered" else stats.fused_steps) > 0
    assert [list(h) + r for h, r in zip(heads, rest, strict=True)] == expected[:2]
    assert later == expected[2:]


def test_the_batch_and_the_trie_count_the_quantized_bytes(folders: Callable[[str], Path]) -> None:
    """What admission and the trie's budget see is what the codes and groups take."""
    folder = folders("llama")
    loaded = load(folder)
    caches = quantizing(loaded.model.make_caches, 8)()
    loaded.model.forward(mx.array([prompt(30, 1, ENGINE_KINDS["llama"][1])]), caches)
    held = [c.held() for c in caches if isinstance(c, QuantizedKVCache)]
    real = sum(q.nbytes for pair in held if pair is not None for q in pair)
    snaps = [c.snapshot(0) for c in caches]
    assert sum(s.nbytes for s in snaps if s is not None) == real
    floats = [c.snapshot(0) for c in _forward_float(loaded.model)]
    # head_dim 32: 32 bytes of codes and a float32 scale and bias per 32 values, 40 of
    # 128 bytes of float32
    assert real * 128 == sum(s.nbytes for s in floats if s is not None) * 40
    assert np.isclose(sum(c.nbytes for c in caches), real * 256 / 30, rtol=0.05)


def _forward_float(model: Any) -> list[Any]:
    caches = model.make_caches()
    model.forward(mx.array([prompt(30, 1, ENGINE_KINDS["llama"][1])]), caches)
    return list(caches)
