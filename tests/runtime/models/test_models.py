"""Architectures against transformers on tiny random models, and the caches' contracts:
chunked prefill and step-by-step decode must give the logits one full pass gives."""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.cache import Cache, KVCache, RotatingKVCache, window_mask
from runtime.models import build_model, supported_model_types
from runtime.models.base import attention
from tests.support.model_checks import (
    TinyModels,
    assert_chunked_prefill_then_decode,
    assert_matches_transformers,
    assert_step_decode_matches_full,
    chunked,
    forward,
    random_tokens,
)
from tests.support.tiny_models import (
    GEMMA_WINDOW,
    VARIANTS,
    VOCAB,
    load_mlx,
    make_tiny,
    torch_logits,
)

SEQ = 40
ATOL = 1e-4
# variants whose cache behaviour differs: plain, sliding window (gemma3), qk-norm (qwen3)
CACHE_VARIANTS = ("llama", "qwen3", "gemma3_text")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_tiny)


def _tokens(n: int = SEQ, seed: int = 1) -> np.ndarray[Any, Any]:
    return random_tokens(VOCAB, n, seed)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name: str, tiny: TinyModels) -> None:
    assert_matches_transformers(*tiny[name], _tokens(), ATOL)


@pytest.mark.parametrize("chunk", [7, 16])
@pytest.mark.parametrize("name", CACHE_VARIANTS)
def test_chunked_prefill_then_decode_matches_one_shot(
    name: str, chunk: int, tiny: TinyModels
) -> None:
    model = load_mlx(tiny[name][1])
    assert_chunked_prefill_then_decode(model, _tokens(SEQ + 5), SEQ, chunk, ATOL)


@pytest.mark.parametrize("name", CACHE_VARIANTS)
def test_step_decode_matches_full_sequence(name: str, tiny: TinyModels) -> None:
    model = load_mlx(tiny[name][1])
    assert_step_decode_matches_full(model, _tokens(), ATOL)


def test_gemma3_any_chunk_schedule_matches(tiny: TinyModels) -> None:
    """Every transition: chunks below, at and above the window, decode before and after
    the ring wraps, and a chunk arriving while the ring is mid-rotation."""
    model = load_mlx(tiny["gemma3_text"][1])
    tokens = _tokens(60)
    full = forward(model, tokens, model.make_caches())
    sizes = [3, 1, 1, 9, 1, 1, 1, 7, GEMMA_WINDOW, 1, 2, 1, 16, 1, 1, 1, 5]
    got = chunked(model, tokens, sizes, model.make_caches())
    np.testing.assert_allclose(got, full, atol=ATOL, rtol=0)


def test_sliding_layers_served_by_growing_caches(tiny: TinyModels) -> None:
    """A KVCache keeps every token; the layer's window mask must still hide the old ones."""
    model = load_mlx(tiny["gemma3_text"][1])
    tokens = _tokens()
    full = forward(model, tokens, model.make_caches())
    plain: list[Cache] = [KVCache(step=5) for _ in range(model.args.num_layers)]
    np.testing.assert_allclose(chunked(model, tokens, [7, 1], plain), full, atol=ATOL, rtol=0)


def test_window_is_what_transformers_uses(tiny: TinyModels) -> None:
    """Guard the test's power: a window one token wider gives different logits."""
    model = load_mlx(tiny["gemma3_text"][1])
    tokens = _tokens()
    wider: list[Cache] = [
        RotatingKVCache(c.max_size + 1) if isinstance(c, RotatingKVCache) else c
        for c in model.make_caches()
    ]
    assert any(isinstance(c, RotatingKVCache) for c in wider)
    got = chunked(model, tokens, [1], wider)
    assert not np.allclose(got, torch_logits(tiny["gemma3_text"][0], tokens), atol=ATOL)


def test_make_caches_follow_layer_types(tiny: TinyModels) -> None:
    model = load_mlx(tiny["gemma3_text"][1])
    kinds = [type(c).__name__ for c in model.make_caches()]
    assert kinds == ["RotatingKVCache", "KVCache", "RotatingKVCache", "KVCache"]
    sizes = {c.max_size for c in model.make_caches() if isinstance(c, RotatingKVCache)}
    assert sizes == {GEMMA_WINDOW}
    llama = load_mlx(tiny["llama"][1])
    assert all(type(c) is KVCache for c in llama.make_caches())


def test_build_model_registry() -> None:
    assert {"gemma3", "gemma3_text", "llama", "qwen2", "qwen3"} <= set(supported_model_types())
    with pytest.raises(ValueError, match="unsupported model_type"):
        build_model({"model_type": "gpt2"})


def test_gemma3_multimodal_config_defaults_and_layer_pattern() -> None:
    """A real multimodal config lists only what differs from Gemma3TextConfig."""
    model = build_model(
        {
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 7,
                "vocab_size": 300,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "sliding_window": 16,
            },
            # the geometry of every Gemma 3 vision tower (SigLIP's defaults do not pool)
            "vision_config": {
                "model_type": "siglip_vision_model",
                "image_size": 896,
                "patch_size": 14,
            },
        }
    )
    args: Any = model.args
    assert args.layer_types[5] == "full_attention" and args.layer_types.count("full_attention") == 1
    assert (args.rope_global.rope_type, args.rope_global.factor) == ("linear", 8.0)
    assert args.rope_global.theta == 1_000_000.0 and args.rope_local.theta == 10_000.0
    assert args.rope_local.rope_type == "default"
    assert (args.head_dim, args.num_attention_heads, args.max_position_embeddings) == (
        256,
        8,
        131_072,
    )


def test_kv_cache_grows_and_trims() -> None:
    cache = KVCache(step=4)
    k = mx.arange(2 * 10 * 3, dtype=mx.float32).reshape(1, 2, 10, 3)
    got_k, got_v = cache.update_and_fetch(k[:, :, :3], k[:, :, :3] + 1)
    assert got_k.shape == (1, 2, 3, 3) and cache.nbytes == 2 * 2 * 4 * 3 * 4
    for i in range(3, 10):
        got_k, got_v = cache.update_and_fetch(k[:, :, i : i + 1], k[:, :, i : i + 1] + 1)
    assert cache.offset == 10
    np.testing.assert_array_equal(np.array(got_k), np.array(k))
    np.testing.assert_array_equal(np.array(got_v), np.array(k) + 1)
    assert cache.trim(4) == 4 and cache.offset == 6
    got_k, _ = cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
    np.testing.assert_array_equal(np.array(got_k[:, :, 6]), np.array(k[:, :, 0]))
    assert cache.trim(100) == 7 and cache.offset == 0


def test_rotating_cache_trim_rules() -> None:
    window = 4
    cache = RotatingKVCache(window)
    k = mx.arange(12, dtype=mx.float32).reshape(1, 1, 12, 1)
    cache.update_and_fetch(k[:, :, :3], k[:, :, :3])
    assert cache.trim(2) == 2 and cache.offset == 1  # nothing has slid out yet
    for i in range(1, 7):
        cache.update_and_fetch(k[:, :, i : i + 1], k[:, :, i : i + 1])
    assert cache.offset == 7
    assert cache.trim(2) == 0 and cache.offset == 7  # would leave too little history
    assert cache.trim(1) == 1 and cache.offset == 6  # the window minus one remains
    keys, _ = cache.update_and_fetch(k[:, :, 6:8], k[:, :, 6:8])
    # previous window - 1 (positions 3..5) in order, then the chunk
    assert np.array(keys).ravel().tolist() == [3, 4, 5, 6, 7]


def test_masks() -> None:
    assert KVCache().make_mask(1) is None
    assert KVCache().make_mask(5) == "causal"
    assert np.array(window_mask(2, 4, 2)).tolist() == [
        [False, True, True, False],
        [False, False, True, True],
    ]
    rot = RotatingKVCache(3)
    assert rot.make_mask(3) == "causal"
    assert np.array(rot.make_mask(4)).shape == (4, 4)
    rot.update_and_fetch(mx.zeros((1, 1, 5, 2)), mx.zeros((1, 1, 5, 2)))
    assert rot.make_mask(1) is None
    assert np.array(rot.make_mask(2)).shape == (2, 4)


def test_softcapped_attention_tends_to_plain_attention() -> None:
    """With a huge cap tanh is the identity, so the unfused path must equal the kernel's."""
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 4, 5, 8)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 7, 8)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 7, 8)).astype(np.float32))
    for mask in (None, "causal", window_mask(5, 7, 3)):
        plain = attention(q, k, v, scale=0.3, mask=mask)
        capped = attention(q, k, v, scale=0.3, mask=mask, softcap=1e6)
        np.testing.assert_allclose(np.array(capped), np.array(plain), atol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "window"])
@pytest.mark.parametrize(("length", "keys"), [(40, 40), (33, 57), (9, 9)])
def test_blocked_causal_attention_equals_one_shot(kind: str, length: int, keys: int) -> None:
    mx.random.seed(3)
    q = mx.random.normal((1, 4, length, 16))
    k, v = mx.random.normal((1, 2, keys, 16)), mx.random.normal((1, 2, keys, 16))
    mask: mx.array | Literal["causal"] = (
        "causal" if kind == "causal" else window_mask(length, keys, 7)
    )
    whole = attention(q, k, v, scale=0.25, mask=mask, block=10**6)
    blocked = attention(q, k, v, scale=0.25, mask=mask, block=8)
    assert mx.allclose(whole, blocked, atol=1e-5).item()
