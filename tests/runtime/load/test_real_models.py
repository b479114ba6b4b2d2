"""Real weights: greedy decoding matches transformers on the same dequantized GGUF weights
(the float path; the CPU serves GGUFs quantized, tracked by test_quantized_path below).

transformers dequantizes the GGUF with its own loader (an independent path from
runtime/load/gguf/reader.py), runs float32 on the CPU, and the first 32 greedy tokens must be
identical to ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from runtime.batch.generate import generate_tokens
from runtime.load.loaded import LoadedModel
from runtime.load.loader import load
from runtime.text.sampling import Sampler
from runtime.types import SamplingParams
from templates import renderer_for
from templates.types import Message, RenderOptions

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.real_model

N_TOKENS = 32
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
]


def _prompt_ids(loaded: LoadedModel, text: str) -> list[int]:
    tok = loaded.tokenizer
    renderer = renderer_for(
        loaded.chat_template,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        model_type=str(loaded.config.get("model_type")),
    )
    rendered = renderer.render((Message("user", text),), (), RenderOptions())
    return tok.encode_prompt(rendered)


def _ours(loaded: LoadedModel, ids: list[int]) -> list[int]:
    sampler = Sampler(SamplingParams(temperature=0.0), loaded.model.args.vocab_size, ids)
    gen = generate_tokens(
        loaded.model, loaded.model.make_caches(), ids, sampler, max_tokens=N_TOKENS
    )
    return [t.token_id for t in gen]


def _reference(gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            past = None
            inputs = torch.tensor([ids])
            tokens: list[int] = []
            for _ in range(N_TOKENS):  # plain greedy loop: no EOS handling, no processors
                res = model(input_ids=inputs, past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = int(res.logits[0, -1].argmax())
                tokens.append(nxt)
                inputs = torch.tensor([[nxt]])
            out.append(tokens)
    return out


@dataclass(frozen=True)
class FloatPath:
    """One GGUF on the float path: the model, PROMPTS' ids and its greedy tokens."""

    loaded: LoadedModel
    prompts: list[list[int]]
    tokens: list[list[int]]


@pytest.fixture(scope="module")
def float_paths() -> dict[str, FloatPath]:
    """Each model's float path, loaded and decoded once for both tests below (a model
    without quantized layers: the decode rows' setting does not reach it)."""
    return {}


def _float_path(fixture: str, request: pytest.FixtureRequest) -> tuple[Path, FloatPath]:
    gguf: Path = request.getfixturevalue(fixture)
    paths: dict[str, FloatPath] = request.getfixturevalue("float_paths")
    if fixture not in paths:
        loaded = load(gguf, keep_quantized=False)
        prompts = [_prompt_ids(loaded, p) for p in PROMPTS]
        paths[fixture] = FloatPath(loaded, prompts, [_ours(loaded, ids) for ids in prompts])
    return gguf, paths[fixture]


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "qwen25_gguf"])
def test_greedy_tokens_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    gguf, path = _float_path(fixture, request)
    loaded, prompts, ours = path.loaded, path.prompts, path.tokens
    ref = _reference(gguf, prompts)
    for text, a, b in zip(PROMPTS, ours, ref, strict=True):
        assert a == b, (
            f"{text!r}\nours: {loaded.tokenizer.decode(a)!r}\nref:  {loaded.tokenizer.decode(b)!r}"
        )
    # and the output is the model talking sense, not a degenerate loop
    assert len(set(ours[0])) > 8


@pytest.mark.served_rows  # the default int16 rows (conftest.py pins float32 elsewhere)
@pytest.mark.parametrize("fixture", ["smollm2_gguf", "qwen25_gguf"])
def test_quantized_path_tracks_the_float_path(fixture: str, request: pytest.FixtureRequest) -> None:
    """What the CPU serves by default (weights quantized, decode rows rounded to int16 per
    block of 32: runtime/kernels/qdot.c) against the float path on the float path's own
    greedy tokens, teacher-forced through decode steps: the logits stay close and pick
    the same token. (Against llama.cpp: bench/greedy_agreement.py.)"""
    gguf, path = _float_path(fixture, request)
    floats, served = path.loaded, load(gguf)
    assert served.quantized and served.weight_format == "gguf-native"
    ids, tokens = path.prompts[0], path.tokens[0]
    want = _decode_logits(floats, ids, tokens)
    got = _decode_logits(served, ids, tokens)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    assert np.abs(got - want).max() <= 0.1 * want.std(axis=-1).min()


def _decode_logits(loaded: LoadedModel, ids: list[int], tokens: list[int]) -> np.ndarray:
    """The logits before each of `tokens`: the prompt's last, then one decode step each."""
    model, caches = loaded.model, loaded.model.make_caches()
    rows = [model.logits(model.forward(mx.array([ids]), caches))[0, -1]]
    for token in tokens[:-1]:
        rows.append(model.logits(model.forward(mx.array([[token]]), caches))[0, -1])
    return np.array(mx.stack(rows).astype(mx.float32))
