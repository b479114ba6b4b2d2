"""The hybrid Qwen models (qwen3_next, qwen3_5 dense and MoE) against transformers, their
caches' contracts (chunked prefill and step decode equal one full pass), the delta rule's
chunked form against its recurrence, loading, and the prefix cache over recurrent layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.cache import KVCache, LayerCache, RecurrentCache, RecurrentSnapshot
from runtime.load.loader import load
from runtime.models import LanguageModel, build_model
from runtime.models.gated_delta import (
    GatedDeltaNet,
    delta_rule_chunked,
    delta_rule_recurrent,
    unit_lower_inverse,
)
from runtime.models.qwen3_next import LINEAR_ATTENTION, sanitize_hybrid
from runtime.prefix.cache import PrefixCache
from runtime.vision.spans import grid_of
from tests.support.model_checks import (
    TinyModels,
    assert_matches_transformers,
    chunked,
    forward,
    random_tokens,
)
from tests.support.tiny_hybrid import VARIANTS, VOCAB, make_tiny, write_tokenizer
from tests.support.tiny_models import load_mlx, quantize_weight, save_quantized, torch_logits

SEQ = 100  # over transformers' 64-token chunk, and ours
ATOL = 1e-4
BIG = 10**9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_tiny)


def _tokens(n: int = SEQ, seed: int = 1) -> np.ndarray[Any, Any]:
    return random_tokens(VOCAB, n, seed)


# -- against transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name: str, tiny: TinyModels) -> None:
    assert_matches_transformers(*tiny[name], _tokens(), ATOL)


def test_hf_folder_loads_through_the_loader(tiny: TinyModels) -> None:
    hf, directory = tiny["qwen3_5_moe"]
    write_tokenizer(directory)
    loaded = load(directory)
    # with its vision tower (tests/test_models_qwen_vision*.py read images with it)
    assert grid_of(loaded.model) is not None
    tokens = _tokens(40)
    got = forward(loaded.model, tokens, loaded.model.make_caches())
    np.testing.assert_allclose(got, torch_logits(hf, tokens), atol=ATOL, rtol=0)
    assert loaded.context_length == 512  # from text_config


# -- caches: chunk schedules and decode --------------------------------------------------------

SCHEDULES = {
    "sevens": [7],
    "mixed": [1, 2, 3, 64, 5, 30, 1],
    "around_chunk": [63, 1, 65, 1],
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_any_chunk_schedule_matches_one_shot(name: str, schedule: str, tiny: TinyModels) -> None:
    model = load_mlx(tiny[name][1])
    tokens = _tokens(SEQ + 40)
    full = forward(model, tokens, model.make_caches())
    got = chunked(model, tokens, SCHEDULES[schedule])
    np.testing.assert_allclose(got, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_step_decode_matches_full_sequence(name: str, tiny: TinyModels) -> None:
    model = load_mlx(tiny[name][1])
    tokens = _tokens(48)
    full = forward(model, tokens, model.make_caches())
    np.testing.assert_allclose(chunked(model, tokens, [20, 1]), full, atol=ATOL, rtol=0)
    np.testing.assert_allclose(chunked(model, tokens, [1]), full, atol=ATOL, rtol=0)


def test_layer_chunk_size_does_not_change_the_result(tiny: TinyModels) -> None:
    model: Any = load_mlx(tiny["qwen3_5"][1])
    tokens = _tokens()
    reference = forward(model, tokens, model.make_caches())
    mixers = [m for _, m in model.named_modules() if isinstance(m, GatedDeltaNet)]
    assert mixers
    for chunk in (1, 5, 16, 128):
        for mixer in mixers:
            mixer.chunk = chunk
        got = forward(model, tokens, model.make_caches())
        np.testing.assert_allclose(got, reference, atol=ATOL, rtol=0)


# -- the delta rule on its own ------------------------------------------------------------------


def _delta_inputs(
    length: int, heads: int = 3, k_dim: int = 16, v_dim: int = 8, seed: int = 0, decay: float = 1.0
) -> tuple[mx.array, ...]:
    rng = np.random.default_rng(seed)

    def unit(shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit((1, heads, length, k_dim)) * k_dim**-0.5
    k = unit((1, heads, length, k_dim))
    v = rng.standard_normal((1, heads, length, v_dim))
    # from no decay at all to exp(-decay * 20) per token (underflows over a chunk)
    g = -(rng.uniform(0, 1, (1, heads, length)) ** 3) * decay * 20
    beta = rng.uniform(0, 1, (1, heads, length))
    state = rng.standard_normal((1, heads, k_dim, v_dim))
    return tuple(mx.array(a.astype(np.float32)) for a in (q, k, v, g, beta, state))


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
@pytest.mark.parametrize("length", [1, 5, 64, 130])
def test_chunked_delta_rule_equals_recurrent(length: int, chunk: int) -> None:
    q, k, v, g, beta, state = _delta_inputs(length, seed=length + chunk)
    want_out, want_state = delta_rule_recurrent(q, k, v, g, beta, state)
    out, new_state = delta_rule_chunked(q, k, v, g, beta, state, chunk)
    assert out.shape == want_out.shape and new_state.shape == want_state.shape
    np.testing.assert_allclose(np.array(out), np.array(want_out), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(new_state), np.array(want_state), atol=1e-5, rtol=1e-5)


def test_delta_rule_without_decay_and_with_full_writes() -> None:
    """g = 0 and beta = 1 (no forgetting, keys overwritten): the hardest solve."""
    q, k, v, g, beta, state = _delta_inputs(96, seed=5)
    # few distinct keys, so many writes hit nearly the same direction
    k = mx.repeat(k[:, :, :12], 8, axis=2)
    g, beta = mx.zeros_like(g), mx.ones_like(beta)
    want_out, want_state = delta_rule_recurrent(q, k, v, g, beta, state)
    out, new_state = delta_rule_chunked(q, k, v, g, beta, state, 64)
    np.testing.assert_allclose(np.array(out), np.array(want_out), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(new_state), np.array(want_state), atol=1e-4, rtol=1e-4)


def _forward_substitution(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """(I + a)^-1 row by row in a's precision: what a triangular solve does."""
    n = a.shape[-1]
    eye = np.eye(n, dtype=a.dtype)
    inv = np.zeros_like(a)
    for i in range(n):
        inv[..., i, :] = eye[i] - np.einsum("...j,...jk->...k", a[..., i, :i], inv[..., :i, :])
    return inv


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33, 64])
def test_unit_lower_inverse(n: int) -> None:
    rng = np.random.default_rng(n)
    # the delta rule's systems: beta_t k_t.k_s below the diagonal, unit keys
    k = rng.standard_normal((2, 3, n, 16))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    a = np.tril(rng.uniform(0, 1, (2, 3, n, 1)) * (k @ k.swapaxes(-1, -2)), -1)
    got = np.array(unit_lower_inverse(mx.array(a.astype(np.float32))))
    np.testing.assert_allclose(got, np.linalg.inv(np.eye(n) + a), atol=1e-6, rtol=0)
    # ill-conditioned systems: as accurate as forward substitution in float32
    a = np.tril(rng.uniform(-1, 1, (2, 3, n, n)), -1).astype(np.float32)
    want = np.linalg.inv(np.eye(n) + a.astype(np.float64))
    got = np.array(unit_lower_inverse(mx.array(a)))
    baseline = np.abs(_forward_substitution(a) - want).max()
    assert np.abs(got - want).max() <= 4 * baseline + 1e-6


# -- configs and checkpoints -----------------------------------------------------------------


def test_config_readers(tiny: TinyModels) -> None:
    nxt: Any = load_mlx(tiny["qwen3_next"][1]).args
    assert nxt.layer_types == (LINEAR_ATTENTION, "full_attention") * 2
    assert nxt.sparse_layers == (True, False, True, True)  # mlp_only_layers=[1]
    assert nxt.rotary_dim == 8  # head_dim 16 * partial_rotary_factor 0.5
    old: Any = load_mlx(tiny["qwen3_next_old_keys"][1]).args
    assert (old.layer_types, old.rotary_dim, old.rope) == (nxt.layer_types, 8, nxt.rope)
    moe: Any = load_mlx(tiny["qwen3_5_moe"][1]).args
    assert moe.sparse_layers == (True,) * 4 and moe.norm_topk_prob
    dense: Any = load_mlx(tiny["qwen3_5"][1]).args
    assert dense.num_experts == 0 and not any(dense.sparse_layers)
    assert dense.layer_types == (LINEAR_ATTENTION,) * 3 + ("full_attention",)
    # a published-style config: only what differs from transformers' defaults
    real: Any = build_model(
        {
            "model_type": "qwen3_5",
            "text_config": {
                "hidden_size": 64,
                "num_hidden_layers": 8,
                "num_attention_heads": 4,
                "vocab_size": 300,
                "intermediate_size": 96,
            },
            "vision_config": {},
        }
    ).args
    assert real.layer_types.count("full_attention") == 2 and real.layer_types[3] == "full_attention"
    assert (real.head_dim, real.rotary_dim, real.linear.head_k_dim) == (256, 64, 128)


def test_make_caches_follow_layer_types(tiny: TinyModels) -> None:
    model = load_mlx(tiny["qwen3_5_text"][1])
    kinds = [type(c) for c in model.make_caches()]
    assert kinds == [RecurrentCache, RecurrentCache, KVCache]


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_converted_checkpoints_load_the_same(name: str, tiny: TinyModels) -> None:
    """mlx-lm's converted layout (conv as (C, K, 1), norms as 1 + weight, stacked experts;
    qwen3_next's projections still fused, qwen3_5's under ``language_model.``) loads to
    the same model; sanitize is idempotent (the loader runs it twice on quantized folders)."""
    directory = tiny[name][1]
    model: Any = load_mlx(directory)
    raw = mx.load(str(directory / "model.safetensors"))
    assert isinstance(raw, dict)
    once = model.sanitize(dict(raw))
    twice = model.sanitize(dict(once))
    assert set(twice) == set(once)
    for key, value in twice.items():
        assert mx.array_equal(value, once[key]), key
    if name.startswith("qwen3_5"):
        converted_weights = {
            f"language_model.{k}" if k.startswith(("model.", "lm_head.")) else k: v
            for k, v in once.items()
        }
    else:
        converted_weights = sanitize_hybrid(dict(raw), model.args)
        assert any(k.endswith("in_proj_qkvz.weight") for k in converted_weights)
    config = json.loads((directory / "config.json").read_text())
    converted = build_model(config)
    converted.load_weights(list(converted.sanitize(converted_weights).items()), strict=True)
    tokens = _tokens(30)
    np.testing.assert_allclose(
        forward(converted, tokens, converted.make_caches()),
        forward(model, tokens, model.make_caches()),
        atol=1e-6,
        rtol=0,
    )


def test_linear_layer_rejects_an_attention_cache(tiny: TinyModels) -> None:
    model = load_mlx(tiny["qwen3_5_text"][1])
    with pytest.raises(TypeError, match="recurrent cache"):
        model(mx.array(_tokens(4)), [KVCache() for _ in range(3)])


# -- the prefix cache over recurrent layers -------------------------------------------------------


def _serve(
    pc: PrefixCache[Any], model: LanguageModel, prompt: list[int], new: int
) -> tuple[int, np.ndarray[Any, Any], list[int]]:
    """One request: restore, prefill pausing at the snapshot points, greedy decode.
    Returns (tokens reused, logits of every position run, generated tokens)."""
    lease = pc.begin(prompt)
    pos, outs = lease.reused, []
    for stop in [*lease.snapshot_points, len(prompt)]:
        if stop > pos:
            outs.append(forward(model, np.array([prompt[pos:stop]], np.int32), lease.caches))
            pos = stop
        if stop in lease.snapshot_points:
            pc.snapshot_at(lease, stop)
    generated = [int(outs[-1][0, -1].argmax())]
    while len(generated) < new:
        step = forward(model, np.array([generated[-1:]], np.int32), lease.caches)
        generated.append(int(step[0, -1].argmax()))
    held = lease.caches[0].offset
    pc.end(lease, [*prompt, *generated][:held])
    pc.verify()
    return lease.reused, np.concatenate(outs, axis=1), generated


def _cold(model: LanguageModel, tokens: list[int]) -> Any:
    return forward(model, np.array([tokens], np.int32), model.make_caches())


def test_second_turn_restores_from_a_snapshot(tiny: TinyModels) -> None:
    model = load_mlx(tiny["qwen3_5"][1])
    pc: PrefixCache[LayerCache] = PrefixCache(
        model.make_caches, budget_bytes=BIG, snapshot_interval=8, tail_keep=2
    )
    first = [int(t) for t in _tokens(30, seed=3)[0]]
    reused, _, answer = _serve(pc, model, first, 3)
    assert reused == 0
    # another conversation takes the live caches, so the next turn must restore
    _serve(pc, model, [7, *first[1:12]], 2)
    second = [*first, *answer, 11, 12, 13, 14, 15]
    reused, logits, _ = _serve(pc, model, second, 2)
    # the snapshot taken where the first turn's state ended (its last token never ran)
    assert reused == len(first) + len(answer) - 1
    np.testing.assert_allclose(logits, _cold(model, second)[:, reused:], atol=ATOL, rtol=0)


def test_restores_only_at_snapshot_offsets(tiny: TinyModels) -> None:
    model = load_mlx(tiny["qwen3_next"][1])
    pc: PrefixCache[LayerCache] = PrefixCache(
        model.make_caches, budget_bytes=BIG, snapshot_interval=8, tail_keep=2
    )
    first = [int(t) for t in _tokens(30, seed=4)[0]]
    _serve(pc, model, first, 2)
    _serve(pc, model, [5, 6, 7], 2)
    # shares 20 tokens; recurrent state exists at 8, 16, 24 and 28 only
    branch = [*first[:20], 1, 2, 3, 4]
    reused, logits, _ = _serve(pc, model, branch, 2)
    assert reused == 16
    np.testing.assert_allclose(logits, _cold(model, branch)[:, reused:], atol=ATOL, rtol=0)


def test_recurrent_snapshot_restores_at_its_offset_only(tiny: TinyModels) -> None:
    model = load_mlx(tiny["qwen3_5"][1])
    caches = model.make_caches()
    tokens = _tokens(24)
    forward(model, tokens[:, :20], caches)
    snaps = [c.snapshot(0) for c in caches]
    recurrent = [
        (c, s) for c, s in zip(caches, snaps, strict=True) if isinstance(c, RecurrentCache)
    ]
    assert recurrent
    for live, snap in recurrent:
        assert isinstance(snap, RecurrentSnapshot) and snap.end == 20
        fresh = RecurrentCache()
        for wrong in (19, 21, 12):
            assert not fresh.restore(snap, wrong) and fresh.offset == 0
        assert not live.restore(None, 12) and live.offset == 20  # cannot rewind live
    # restored at its own offset, decoding on gives the cold run's logits
    restored = model.make_caches()
    for cache, snap in zip(restored, snaps, strict=True):
        assert snap is not None and cache.restore(snap, 20)
    got = forward(model, tokens[:, 20:], restored)
    np.testing.assert_allclose(got, forward(model, tokens, model.make_caches())[:, 20:], atol=ATOL)


def _quantized_converted_folder(src: Path, model: LanguageModel, dst: Path) -> None:
    """An mlx-community style copy of a qwen3_5_moe folder: sanitized weights under
    ``language_model.`` names, 4-bit, with the routers 8-bit and their overrides keyed by
    those names (as mlx-lm writes them)."""
    raw = mx.load(str(src / "model.safetensors"))
    assert isinstance(raw, dict)
    out: dict[str, mx.array] = {}
    overrides: dict[str, Any] = {}
    for name, value in model.sanitize(dict(raw)).items():
        if name.startswith("visual."):
            continue  # a text-only conversion (mlx-lm's drops the vision tower)
        full = f"language_model.{name}"
        linear = name.endswith(".weight") and value.ndim in (2, 3) and "conv1d" not in name
        if linear and "embed" not in name and value.shape[-1] % 32 == 0:
            quantize_weight(out, overrides, full, value)
        else:
            out[full] = value
    save_quantized(src, dst, out, overrides)
    write_tokenizer(dst)


def test_quantized_converted_folder_keeps_its_overrides(tiny: TinyModels, tmp_path: Path) -> None:
    """Per-module quantization overrides name the converted model's paths; sanitize drops
    their ``language_model.`` prefix, and the loader must still find them."""
    directory = tiny["qwen3_5_moe"][1]
    _quantized_converted_folder(directory, load_mlx(directory), tmp_path / "q")
    dequantized = load(tmp_path / "q", keep_quantized=False)
    kept = load(tmp_path / "q", keep_quantized=True)
    assert kept.quantized and not dequantized.quantized
    tokens = _tokens(24)
    np.testing.assert_allclose(
        forward(kept.model, tokens, kept.model.make_caches()),
        forward(dequantized.model, tokens, dequantized.model.make_caches()),
        atol=1e-4,
        rtol=1e-4,
    )
