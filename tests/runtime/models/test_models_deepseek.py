"""DeepSeek V3: multi-head latent attention and grouped sigmoid MoE against transformers on
tiny random models; the absorbed (decode) and expanded (prefill) forms of MLA against each
other; the latent cache's paging and its size; the prefix cache over it (and over V2's and
GLM-4.7-Flash's, the same latent caches); loading."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedLinear, quantize
from mlx.utils import tree_flatten

from runtime.cache import KVCache, LatentCache
from runtime.load.loader import load
from runtime.models import build_model, supported_model_types
from runtime.models.deepseek_v3 import Model, ModelArgs
from runtime.models.mla import MLAConfig, MultiLatentAttention, use_absorbed
from runtime.models.moe import SparseMoE
from runtime.prefix.cache import PrefixCache
from tests.support.model_checks import (
    TinyModels,
    assert_matches_transformers,
    chunked,
    forward,
    random_tokens,
)
from tests.support.tiny_deepseek import (
    HEADS,
    KV_LORA_RANK,
    LAYERS,
    QK_NOPE,
    QK_ROPE,
    V_HEAD,
    VARIANTS,
    VOCAB,
    add_mtp_layer,
    make_tiny,
    torch_state,
)
from tests.support.tiny_models import load_mlx, torch_logits, write_tokenizer

SEQ = 40
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_tiny)


def _model(directory: Path) -> Model:
    model = load_mlx(directory)
    assert isinstance(model, Model)
    return model


def _tokens(n: int = SEQ, seed: int = 1) -> np.ndarray[Any, Any]:
    return random_tokens(VOCAB, n, seed)


def _force(model: Model, absorb: bool | None) -> None:
    """Make every MLA layer use one form (None: the cost model's choice)."""
    for layer in model.model.layers:
        layer.self_attn.absorb = absorb


# -- against transformers -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name: str, tiny: TinyModels) -> None:
    assert_matches_transformers(*tiny[name], _tokens(), ATOL)


def test_tiny_models_cover_what_they_claim(tiny: TinyModels) -> None:
    """Guard the oracle's power: the variants exercise the switches they name."""
    model = _model(tiny["deepseek_v3"][1])
    args = model.args
    assert [args.is_sparse(i) for i in range(LAYERS)] == [False, True, True]
    assert args.mla.q_lora_rank == 32 and args.mla.rope.rope_type == "yarn"
    assert args.mla.scale != args.mla.qk_head_dim**-0.5  # mscale_all_dim enters the scale
    assert (args.n_group, args.topk_group, args.routed_scaling_factor) == (4, 2, 2.5)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert float(mx.abs(bias).max()) > 0
    plain = _model(tiny["deepseek_v3_plain"][1]).args
    assert plain.mla.q_lora_rank is None and not plain.mla.rope_interleave
    assert plain.is_sparse(0) and plain.n_shared_experts == 2 and not plain.norm_topk_prob
    old = json.loads((tiny["deepseek_v3_old_rope_keys"][1] / "config.json").read_text())
    assert "rope_parameters" not in old and old["rope_scaling"]["type"] == "yarn"


def test_wrong_softmax_scale_changes_the_logits(tiny: TinyModels) -> None:
    """The yarn mscale correction is visible at this tolerance (so it is tested)."""
    hf, directory = tiny["deepseek_v3"]
    model = _model(directory)
    for layer in model.model.layers:
        layer.self_attn.scale = model.args.mla.qk_head_dim**-0.5
    tokens = _tokens()
    got = forward(model, tokens, model.make_caches())
    assert not np.allclose(got, torch_logits(hf, tokens), atol=ATOL)


# -- caches: chunks, decode, the two forms of MLA -------------------------------------------


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_then_decode_matches_one_shot(chunk: int, tiny: TinyModels) -> None:
    model = _model(tiny["deepseek_v3"][1])
    tokens = _tokens(SEQ + 5)
    full = forward(model, tokens, model.make_caches())
    got = chunked(model, tokens[:, :SEQ], [chunk])
    np.testing.assert_allclose(got[:, -1], full[:, SEQ - 1], atol=ATOL, rtol=0)
    caches = model.make_caches()
    forward(model, tokens[:, :SEQ], caches)
    for i in range(SEQ, SEQ + 5):
        step = forward(model, tokens[:, i : i + 1], caches)
        np.testing.assert_allclose(step[:, 0], full[:, i], atol=ATOL, rtol=0)
    assert all(c.offset == SEQ + 5 for c in caches)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_plain"])
def test_absorbed_decode_equals_expanded_prefill(name: str, tiny: TinyModels) -> None:
    """Step decode (absorbed) gives the logits of one full expanded pass, and so do
    chunks attended in the absorbed form (its causal mask over cached tokens)."""
    model = _model(tiny[name][1])
    tokens = _tokens()
    _force(model, False)
    full = forward(model, tokens, model.make_caches())
    _force(model, True)
    np.testing.assert_allclose(chunked(model, tokens, [1]), full, atol=ATOL, rtol=0)
    np.testing.assert_allclose(chunked(model, tokens, [6, 1, 9]), full, atol=ATOL, rtol=0)
    _force(model, False)
    np.testing.assert_allclose(chunked(model, tokens, [5, 1, 12]), full, atol=ATOL, rtol=0)


def test_cost_model_absorbs_decode_and_expands_long_prefill() -> None:
    tiny = ModelArgs.from_config(_config(q_lora_rank=None)).mla
    assert use_absorbed(tiny, 1, 40) and use_absorbed(tiny, 16, 56)
    assert not use_absorbed(tiny, 40, 40)
    v3 = ModelArgs.from_config({**_config(), **_V3_ATTENTION}).mla
    assert use_absorbed(v3, 1, 100_000) and use_absorbed(v3, 64, 4096)
    assert not use_absorbed(v3, 2048, 2048) and not use_absorbed(v3, 512, 4096)


def test_quantized_kv_b_proj_absorbs_like_it_expands(tiny: TinyModels) -> None:
    """With kv_b_proj MLX-quantized, the absorbed form folds the packed weights into
    the queries and outputs (quantized_matmul per head) and matches the expanded form."""
    model = _model(tiny["deepseek_v3"][1])

    def kv_b(path: str, module: Any) -> bool:
        return path.endswith("kv_b_proj") and isinstance(module, Linear)

    quantize(model, group_size=32, bits=4, class_predicate=kv_b)
    assert isinstance(model.model.layers[0].self_attn.kv_b_proj, QuantizedLinear)
    tokens = _tokens()
    _force(model, False)
    full = forward(model, tokens, model.make_caches())
    _force(model, True)
    np.testing.assert_allclose(chunked(model, tokens, [3, 1]), full, atol=ATOL, rtol=0)


# -- the latent cache -----------------------------------------------------------------------


def _latent_entries(n: int, start: int = 0) -> tuple[mx.array, mx.array]:
    """Latents and rotary keys whose entries encode their position."""
    pos = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)
    return pos * mx.ones((1, 1, 1, KV_LORA_RANK)), -pos * mx.ones((1, 1, 1, QK_ROPE))


def _held(cache: LatentCache) -> list[int]:
    latents, rope_keys = cache.latents, cache.rope_keys
    assert latents is not None and rope_keys is not None
    positions = np.array(latents)[0, 0, :, 0]
    np.testing.assert_array_equal(np.array(rope_keys)[0, 0, :, 0], -positions)
    return [int(p) for p in positions]


def test_latent_cache_trims_pages_and_restores() -> None:
    cache = LatentCache(step=4)
    for start, size in ((0, 3), (3, 1), (4, 6)):
        cache.update_and_fetch(*_latent_entries(size, start))
    assert cache.offset == 10 and _held(cache) == list(range(10))
    assert cache.trim(3) == 3 and _held(cache) == list(range(7))
    cache.update_and_fetch(*_latent_entries(3, 7))

    whole, tail = cache.snapshot(0), cache.snapshot(6)
    assert whole is not None and tail is not None
    assert (whole.base, whole.end, tail.base, tail.end, tail.floor) == (0, 10, 6, 10, 6)
    fresh = LatentCache(step=4)
    assert not fresh.restore(tail, 10) and fresh.offset == 0  # a delta needs its base
    assert fresh.restore(whole, 8) and _held(fresh) == list(range(8))
    assert fresh.restore(None, 6) and fresh.restore(tail, 10) and _held(fresh) == list(range(10))

    head, rest = cache.split(whole, 4)
    assert head is not None and rest is not None and whole.closed
    merged = cache.merge(head, rest)
    assert merged is not None and (merged.base, merged.end) == (0, 10)
    cache.free()
    assert cache.offset == 0 and cache.nbytes == 0 and cache.latents is None
    assert cache.restore(merged, 10) and _held(cache) == list(range(10))
    for snap in (tail, merged):
        snap.close()
        assert snap.nbytes == 0


def test_latent_cache_rejects_per_head_entries() -> None:
    with pytest.raises(ValueError, match="one shared latent"):
        LatentCache().update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 2)))


def test_latent_snapshots_are_a_fraction_of_full_kv(tiny: TinyModels) -> None:
    """Per layer and token the cache holds kv_lora_rank + rope numbers, where expanded
    attention would hold heads x (qk_head_dim + v_head_dim)."""
    model = _model(tiny["deepseek_v3"][1])
    caches = model.make_caches()
    forward(model, _tokens(), caches)
    kv = KVCache()
    kv.update_and_fetch(
        mx.zeros((1, HEADS, SEQ, QK_NOPE + QK_ROPE)), mx.zeros((1, HEADS, SEQ, V_HEAD))
    )
    kv_snap = kv.snapshot(0)
    assert kv_snap is not None
    for cache in caches:
        assert isinstance(cache, LatentCache)
        snap = cache.snapshot(0)
        assert snap is not None
        assert snap.nbytes == SEQ * (KV_LORA_RANK + QK_ROPE) * 4
        ratio = (KV_LORA_RANK + QK_ROPE) / (HEADS * (QK_NOPE + QK_ROPE + V_HEAD))
        assert snap.nbytes == ratio * kv_snap.nbytes and ratio == 0.25
    # DeepSeek V3's own layer: 576 numbers a token against 40,960 expanded (1.4%)
    v3 = ModelArgs.from_config({**_config(), **_V3_ATTENTION}).mla
    per_token = v3.kv_lora_rank + v3.qk_rope_head_dim
    assert per_token / (v3.num_heads * (v3.qk_head_dim + v3.v_head_dim)) < 0.015


# -- the prefix cache over latent caches -----------------------------------------------------


def _cold(model: Model, prompt: Sequence[int]) -> np.ndarray[Any, Any]:
    """Last-token logits with no cache reuse: everything but the last token, then it."""
    caches = model.make_caches()
    tokens = np.array([prompt], dtype=np.int32)
    forward(model, tokens[:, :-1], caches)
    return np.asarray(forward(model, tokens[:, -1:], caches)[0, -1])


def _serve(pc: PrefixCache[Any], model: Model, prompt: Sequence[int]) -> tuple[int, Any]:
    """One request through the prefix cache, as the runner drives it: prefill from the
    reused offset pausing at the snapshot points, the last token, then end."""
    lease = pc.begin(prompt)
    pc.verify()
    assert all(c.offset == lease.reused for c in lease.caches)
    pos, last = lease.reused, len(prompt) - 1
    for target in sorted({*(p for p in lease.snapshot_points if p <= last), last}):
        if pos < target:
            forward(model, np.array([prompt[pos:target]], dtype=np.int32), lease.caches)
            pos = target
        if target in lease.snapshot_points:
            pc.snapshot_at(lease, target)
    logits = forward(model, np.array([prompt[-1:]], dtype=np.int32), lease.caches)[0, -1]
    pc.end(lease, prompt)
    pc.verify()
    return lease.reused, logits


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite"])
def test_prefix_cache_restores_latent_state(name: str, tiny: TinyModels) -> None:
    model = _model(tiny[name][1])
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(0, VOCAB, 24)]
    first = shared + [int(t) for t in rng.integers(0, VOCAB, 10)]
    second = shared + [int(t) for t in rng.integers(0, VOCAB, 8)]
    third = first + [int(t) for t in rng.integers(0, VOCAB, 3)]
    pc: PrefixCache[Any] = PrefixCache(
        model.make_caches, budget_bytes=10**9, snapshot_interval=4, tail_keep=2
    )

    reused, logits = _serve(pc, model, first)
    assert reused == 0
    np.testing.assert_allclose(logits, _cold(model, first), atol=ATOL, rtol=0)
    # shares `shared` with the live path: rewound in place
    reused, logits = _serve(pc, model, second)
    assert reused == len(shared)
    np.testing.assert_allclose(logits, _cold(model, second), atol=ATOL, rtol=0)
    # the first prompt's own tokens were paged out when the second took the live path
    held = pc.held_snapshots()
    assert held and all(s.nbytes % ((KV_LORA_RANK + QK_ROPE) * 4) == 0 for s in held)
    reused, logits = _serve(pc, model, third)
    assert reused == len(first)
    np.testing.assert_allclose(logits, _cold(model, third), atol=ATOL, rtol=0)


# -- checkpoints: layouts, MTP layers, the loader -------------------------------------------


def test_sanitize_accepts_fused_and_stacked_experts(tiny: TinyModels) -> None:
    hf, directory = tiny["deepseek_v3"]
    tokens = _tokens()
    want = torch_logits(hf, tokens)
    state = torch_state(hf)  # transformers' in-memory names: experts.gate_up_proj etc.
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    config = json.loads((directory / "config.json").read_text())
    fused = build_model(config)
    assert isinstance(fused, Model)
    fused.load_weights(list(fused.sanitize(state).items()), strict=True)
    np.testing.assert_allclose(forward(fused, tokens, fused.make_caches()), want, atol=ATOL)
    # mlx-community's stacked switch_mlp layout is our own parameter layout
    stacked = dict(tree_flatten(fused.parameters()))
    assert any(k.endswith("switch_mlp.gate_proj.weight") for k in stacked)
    again = build_model(config)
    assert isinstance(again, Model)
    again.load_weights(list(again.sanitize(stacked).items()), strict=True)
    np.testing.assert_allclose(forward(again, tokens, again.make_caches()), want, atol=ATOL)


def _mlx_lm_split(weights: dict[str, mx.array], group_size: int | None = None) -> None:
    """Split each kv_b_proj as mlx-lm's sanitize does (mlx-community folders store
    that): embed_q (heads, rank, nope), unembed_out (heads, v, rank); with `group_size`,
    the halves whose last axis allows it are 4-bit quantized along it."""
    for name in [n for n in weights if n.endswith("kv_b_proj.weight")]:
        prefix = name[: -len(".kv_b_proj.weight")]
        per_head = weights.pop(name).reshape(HEADS, QK_NOPE + V_HEAD, -1)
        halves = {
            "embed_q": per_head[:, :QK_NOPE].swapaxes(-1, -2),
            "unembed_out": per_head[:, QK_NOPE:],
        }
        for module, value in halves.items():
            if group_size is None or value.shape[-1] % group_size:
                weights[f"{prefix}.{module}.weight"] = mx.contiguous(value)
                continue
            packed, scales, biases = mx.quantize(value, group_size=group_size, bits=4)
            weights[f"{prefix}.{module}.weight"] = packed
            weights[f"{prefix}.{module}.scales"] = scales
            weights[f"{prefix}.{module}.biases"] = biases


def test_sanitize_fuses_mlx_lm_split_kv_b(tiny: TinyModels) -> None:
    """mlx-lm stores kv_b_proj split in two (float, or quantized along other axes);
    sanitize fuses the halves back into kv_b_proj."""
    _, directory = tiny["deepseek_v3"]
    config = json.loads((directory / "config.json").read_text())
    reference = _model(directory)
    params = dict(tree_flatten(reference.parameters()))
    tokens = _tokens()
    want = forward(reference, tokens, reference.make_caches())
    split = dict(params)
    _mlx_lm_split(split)
    assert not any("kv_b_proj" in k for k in split)
    model = build_model(config)
    assert isinstance(model, Model)
    model.load_weights(list(model.sanitize(split).items()), strict=True)
    np.testing.assert_allclose(forward(model, tokens, model.make_caches()), want, atol=1e-5)
    # a quantized half comes back as its dequantized values, the float one as it was
    quantized = dict(params)
    _mlx_lm_split(quantized, group_size=32)
    assert any(k.endswith("unembed_out.scales") for k in quantized)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    original = params[name].reshape(HEADS, QK_NOPE + V_HEAD, -1)
    got = model.sanitize(quantized)[name].reshape(original.shape)
    packed, scales, biases = mx.quantize(original[:, QK_NOPE:], group_size=32, bits=4)
    values = mx.dequantize(packed, scales, biases, group_size=32, bits=4)
    np.testing.assert_array_equal(np.array(got[:, QK_NOPE:]), np.array(values))
    np.testing.assert_array_equal(np.array(got[:, :QK_NOPE]), np.array(original[:, :QK_NOPE]))


def _write_tokenizer(folder: Path) -> None:
    write_tokenizer(folder, VOCAB, {"eos_token": "w1"})


def test_loader_loads_folder_and_skips_mtp_layers(tiny: TinyModels, tmp_path: Path) -> None:
    hf, directory = tiny["deepseek_v3"]
    folder = tmp_path / "with-mtp"
    shutil.copytree(directory, folder)
    mtp = add_mtp_layer(folder)
    assert "model.layers.3.eh_proj.weight" in mtp
    _write_tokenizer(folder)
    loaded = load(folder)
    assert isinstance(loaded.model, Model) and len(loaded.model.model.layers) == LAYERS
    tokens = _tokens()
    got = forward(loaded.model, tokens, loaded.model.make_caches())
    np.testing.assert_allclose(got, torch_logits(hf, tokens), atol=ATOL, rtol=0)
    assert loaded.tokenizer.encode("w5 w9") == [5, 9]


def test_loader_keeps_an_mlx_quantized_folder_quantized(tiny: TinyModels, tmp_path: Path) -> None:
    """HF names with MLX 4-bit triplets (experts per expert, kv_b_proj included): kept
    quantized, the model computes what the dequantized load computes."""
    _, directory = tiny["deepseek_v3"]
    folder = tmp_path / "q4"
    folder.mkdir()
    weights = mx.load(str(directory / "model.safetensors"))
    assert isinstance(weights, dict)
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        module = name.removesuffix(".weight")
        router = name.endswith("mlp.gate.weight")
        if name.endswith(".weight") and value.ndim == 2 and "embed" not in name and not router:
            packed, scales, biases = mx.quantize(value, group_size=32, bits=4)
            out.update({name: packed, f"{module}.scales": scales, f"{module}.biases": biases})
        else:
            out[name] = value
    mx.save_safetensors(str(folder / "model.safetensors"), out)
    config = json.loads((directory / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    _write_tokenizer(folder)
    kept, floats = load(folder, keep_quantized=True), load(folder, keep_quantized=False)
    assert kept.quantized and not floats.quantized
    assert isinstance(kept.model, Model) and isinstance(floats.model, Model)
    attn = kept.model.model.layers[1].self_attn
    assert isinstance(attn.kv_b_proj, QuantizedLinear)
    tokens = _tokens()
    want = forward(floats.model, tokens, floats.model.make_caches())
    np.testing.assert_allclose(
        forward(kept.model, tokens, kept.model.make_caches()), want, atol=ATOL, rtol=0
    )
    np.testing.assert_allclose(chunked(kept.model, tokens, [4, 1]), want, atol=ATOL, rtol=0)


def test_registered() -> None:
    assert "deepseek_v3" in supported_model_types()


# -- config reading -------------------------------------------------------------------------

_V3_ATTENTION = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def _config(**extra: Any) -> dict[str, Any]:
    config = {
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "vocab_size": VOCAB,
        "kv_lora_rank": KV_LORA_RANK,
        "q_lora_rank": 32,
        "qk_nope_head_dim": QK_NOPE,
        "qk_rope_head_dim": QK_ROPE,
        "v_head_dim": V_HEAD,
    }
    return {**config, **extra}


def test_config_spellings_and_defaults() -> None:
    # DeepSeek V3's released rope_scaling (old spelling, "type"), with factor left out:
    # transformers then takes max_position_embeddings / original
    old = _config(
        max_position_embeddings=16384,
        rope_theta=10_000,
        rope_scaling={
            "type": "yarn",
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    mla = ModelArgs.from_config(old).mla
    assert (mla.rope.rope_type, mla.rope.factor) == ("yarn", 4.0)
    mscale = 0.1 * np.log(4.0) + 1.0
    assert mla.scale == pytest.approx((QK_NOPE + QK_ROPE) ** -0.5 * mscale**2)
    plain = ModelArgs.from_config(_config(rope_parameters={"rope_type": "default"})).mla
    assert plain.scale == (QK_NOPE + QK_ROPE) ** -0.5 and plain.rope_interleave
    # DeepseekV3Config's defaults; a null expert count means a dense model
    args = ModelArgs.from_config(_config())
    assert (args.n_routed_experts, args.first_k_dense_replace, args.n_group) == (256, 3, 8)
    assert ModelArgs.from_config(_config(n_routed_experts=None)).n_routed_experts == 0
    assert not any(
        isinstance(layer.mlp, SparseMoE)
        for layer in Model(ModelArgs.from_config(_config(n_routed_experts=None))).model.layers
    )


def test_moe_layer_rhythm() -> None:
    args = ModelArgs.from_config(
        _config(n_routed_experts=8, first_k_dense_replace=1, moe_layer_freq=2, num_hidden_layers=6)
    )
    assert [args.is_sparse(i) for i in range(6)] == [False, False, True, False, True, False]
    model = Model(args)
    kinds = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert kinds == [args.is_sparse(i) for i in range(6)]
    assert all(isinstance(c, LatentCache) for c in model.make_caches())
    assert isinstance(model.model.layers[0].self_attn, MultiLatentAttention)
    assert MLAConfig.from_config(_config()).q_lora_rank == 32
