"""MoE architectures (qwen3_moe, glm4_moe) against transformers on tiny random models, the
routers against a numpy reference, the expert stacks' gather paths (sorted, unsorted,
quantized), checkpoint layouts, and loading + serving through runtime.load.loader."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from mlx.nn.layers.quantized import quantize as quantize_modules
from mlx.utils import tree_flatten

from runtime.engine import Engine
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.models import build_model, supported_model_types
from runtime.models.moe import (
    SORT_THRESHOLD,
    QuantizedSwitchLinear,
    SwitchGLU,
    grouped_sigmoid_topk,
    softmax_topk,
    stack_experts,
)
from runtime.types import Finished, GenerationRequest, SamplingParams, TextDelta
from tests.support.model_checks import (
    TinyModels,
    assert_chunked_prefill_then_decode,
    assert_matches_transformers,
    assert_step_decode_matches_full,
    forward,
    random_tokens,
)
from tests.support.tiny_models import load_mlx
from tests.support.tiny_moe import MOE_HIDDEN, VARIANTS, VOCAB, make_tiny, torch_greedy

SEQ = 40
ATOL = 1e-4
CACHE_VARIANTS = ("qwen3_moe", "glm4_moe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_tiny)


def _tokens(n: int = SEQ, seed: int = 1, batch: int = 1) -> np.ndarray[Any, Any]:
    return random_tokens(VOCAB, n, seed, batch)


# -- architectures against transformers ----------------------------------------------------


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


@pytest.mark.parametrize("name", CACHE_VARIANTS)
def test_batch_rows_route_independently(name: str, tiny: TinyModels) -> None:
    """A batched forward (one decode step of several sequences) routes each row alone."""
    model = load_mlx(tiny[name][1])
    tokens = _tokens(12, seed=4, batch=3)
    together = forward(model, tokens, model.make_caches())
    for row in range(3):
        alone = forward(model, tokens[row : row + 1], model.make_caches())
        np.testing.assert_allclose(together[row : row + 1], alone, atol=ATOL, rtol=0)


def test_registry_and_layer_plan() -> None:
    assert {"qwen3_moe", "glm4_moe"} <= set(supported_model_types())
    qwen: Any = build_model(
        {
            "model_type": "qwen3_moe",
            "hidden_size": 32,
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_hidden_layers": 6,
            "num_attention_heads": 2,
            "vocab_size": 64,
            "num_experts": 4,  # the pre-transformers-5 name
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert qwen.args.sparse_layers == (False, True, False, False, False, True)
    assert qwen.args.head_dim == 16
    glm: Any = build_model(
        {
            "model_type": "glm4_moe",
            "hidden_size": 32,
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "head_dim": 16,
            "vocab_size": 64,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 2,
        }
    )
    assert glm.args.rotary_dim == 8  # partial_rotary_factor defaults to 0.5
    assert [type(layer.mlp).__name__ for layer in glm.model.layers] == ["MLP", "MLP", "SparseMoE"]


# -- routers against numpy -----------------------------------------------------------------


def _np_softmax_topk(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    z = logits - logits.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(probs, idx, -1)
    return (w / w.sum(-1, keepdims=True) if normalize else w), idx


def _np_grouped(
    logits: np.ndarray,
    bias: np.ndarray,
    k: int,
    groups: int,
    keep: int,
    normalize: bool,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias
    tokens, experts = choice.shape
    group_score = np.sort(choice.reshape(tokens, groups, -1), axis=-1)[..., -2:].sum(-1)
    best_groups = np.argsort(-group_score, axis=-1, kind="stable")[:, :keep]
    allowed = np.zeros((tokens, groups), dtype=bool)
    np.put_along_axis(allowed, best_groups, True, axis=-1)
    masked = np.where(np.repeat(allowed, experts // groups, axis=-1), choice, -np.inf)
    idx = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, idx, -1)
    if normalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scale, idx


def _by_expert(weights: Any, indices: Any) -> list[dict[int, float]]:
    """Each token's {expert: weight} (the routers return their k experts unordered)."""
    w, i = np.asarray(weights).reshape(-1, np.shape(weights)[-1]), np.asarray(indices)
    i = i.reshape(w.shape)
    return [
        dict(zip(row_i.tolist(), row_w.tolist(), strict=True))
        for row_i, row_w in zip(i, w, strict=True)
    ]


def _assert_same_routing(got: tuple[mx.array, mx.array], want: tuple[Any, Any]) -> None:
    ours, ref = _by_expert(*got), _by_expert(*want)
    for mine, theirs in zip(ours, ref, strict=True):
        assert mine.keys() == theirs.keys()
        for expert, weight in theirs.items():
            assert mine[expert] == pytest.approx(weight, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("normalize", [False, True])
def test_softmax_topk_matches_numpy(normalize: bool) -> None:
    logits = np.random.default_rng(0).standard_normal((50, 12)).astype(np.float32) * 2
    got = softmax_topk(mx.array(logits), 3, normalize=normalize)
    assert got[0].dtype == mx.float32 and got[1].dtype == mx.uint32
    _assert_same_routing(got, _np_softmax_topk(logits.astype(np.float64), 3, normalize))


@pytest.mark.parametrize(
    ("groups", "keep", "normalize", "scale"),
    [(1, 1, True, 1.0), (4, 2, True, 2.5), (8, 3, False, 1.8), (4, 4, True, 1.0)],
)
def test_grouped_sigmoid_topk_matches_numpy(
    groups: int, keep: int, normalize: bool, scale: float
) -> None:
    rng = np.random.default_rng(groups * 10 + keep)
    logits = rng.standard_normal((60, 32)).astype(np.float32) * 2
    bias = (rng.standard_normal(32) * 0.3).astype(np.float32)
    got = grouped_sigmoid_topk(
        mx.array(logits),
        4,
        correction_bias=mx.array(bias),
        n_group=groups,
        topk_group=keep,
        normalize=normalize,
        scaling=scale,
    )
    want = _np_grouped(logits.astype(np.float64), bias, 4, groups, keep, normalize, scale)
    _assert_same_routing(got, want)


def test_grouped_routing_never_picks_a_dropped_group() -> None:
    """A dropped group's experts stay out even when every kept score is negative
    (masking to 0 instead of -inf would let them in)."""
    logits = mx.full((1, 8), -30.0)  # sigmoid ~ 1e-13
    bias = mx.array([-1.0, -1.0, -0.5, -0.6, -2.0, -2.0, -2.0, -2.0])
    _, idx = grouped_sigmoid_topk(logits, 2, correction_bias=bias, n_group=4, topk_group=1)
    assert sorted(np.array(idx).ravel().tolist()) == [2, 3]


# -- expert stacks ---------------------------------------------------------------------------


def _random_glu(num_experts: int = 6, dims: int = 64, hidden: int = 32, seed: int = 0) -> SwitchGLU:
    glu = SwitchGLU(dims, hidden, num_experts)
    rng = np.random.default_rng(seed)
    for proj in (glu.gate_proj, glu.up_proj, glu.down_proj):
        proj.weight = mx.array(rng.standard_normal(proj.weight.shape).astype(np.float32) * 0.1)
    return glu


def _np_glu(glu: SwitchGLU, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Reference: each (token, slot) through its expert with plain matmuls."""
    gate, up, down = (np.array(p.weight) for p in (glu.gate_proj, glu.up_proj, glu.down_proj))
    flat_x, flat_i = x.reshape(-1, x.shape[-1]), idx.reshape(-1, idx.shape[-1])
    out = np.zeros((*flat_i.shape, x.shape[-1]), dtype=np.float64)
    for t, row in enumerate(flat_i):
        for s, e in enumerate(row):
            g, u = gate[e] @ flat_x[t], up[e] @ flat_x[t]
            out[t, s] = down[e] @ (g / (1 + np.exp(-g)) * u)
    return out.reshape(*idx.shape, x.shape[-1])


@pytest.mark.parametrize("tokens", [1, 3, 80])  # below and above SORT_THRESHOLD pairs
def test_switch_glu_matches_reference(tokens: int) -> None:
    glu = _random_glu()
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((1, tokens, 64)).astype(np.float32)
    idx = np.stack([rng.choice(6, 2, replace=False) for _ in range(tokens)])[None]
    assert (idx.size >= SORT_THRESHOLD) == (tokens == 80)
    got = glu(mx.array(x), mx.array(idx.astype(np.uint32)))
    np.testing.assert_allclose(np.array(got), _np_glu(glu, x, idx), atol=1e-5, rtol=1e-5)


def test_sorted_path_equals_unsorted_path() -> None:
    glu = _random_glu(num_experts=8)
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((2, 20, 64)).astype(np.float32))
    idx = mx.array(rng.integers(0, 8, (2, 20, 3)).astype(np.uint32))
    rows = mx.expand_dims(x, (-2, -3))
    unsorted = glu._experts(rows, idx, sorted_indices=False).squeeze(-2)
    np.testing.assert_allclose(np.array(glu._sorted(x, idx)), np.array(unsorted), atol=1e-5)


@pytest.mark.parametrize("tokens", [2, 70])
def test_quantized_experts_equal_their_dequantized_weights(tokens: int) -> None:
    """gather_qmm over the quantized stacks == gather_mm over the dequantized floats."""
    glu = _random_glu(num_experts=6, seed=1)
    quantized = _random_glu(num_experts=6, seed=1)
    quantize_modules(quantized, group_size=32, bits=4)
    dequantized = _random_glu(num_experts=6, seed=1)
    for name in ("gate_proj", "up_proj", "down_proj"):
        q = getattr(quantized, name)
        assert isinstance(q, QuantizedSwitchLinear) and q.weight.dtype == mx.uint32
        getattr(dequantized, name).weight = mx.dequantize(
            q.weight, q.scales, q.biases, group_size=32, bits=4
        )
    rng = np.random.default_rng(tokens)
    x = mx.array(rng.standard_normal((1, tokens, 64)).astype(np.float32))
    idx = mx.array(rng.integers(0, 6, (1, tokens, 2)).astype(np.uint32))
    got, want = quantized(x, idx), dequantized(x, idx)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
    # and 4 bits really are a different model from the float one
    assert not np.allclose(np.array(got), np.array(glu(x, idx)), atol=1e-4)


def test_stack_experts_accepts_every_layout() -> None:
    rng = np.random.default_rng(2)
    experts, hidden, dims = 3, 4, 6
    gate, up = rng.standard_normal((2, experts, hidden, dims)).astype(np.float32)
    down = rng.standard_normal((experts, dims, hidden)).astype(np.float32)
    block = "model.layers.0.mlp"
    per_expert = {"other": mx.zeros((1,))}
    for e in range(experts):
        for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            per_expert[f"{block}.experts.{e}.{proj}.weight"] = mx.array(w[e])
            per_expert[f"{block}.experts.{e}.{proj}.scales"] = mx.array(w[e][:, :1])
    fused = {
        f"{block}.experts.gate_up_proj": mx.array(np.concatenate([gate, up], axis=1)),
        f"{block}.experts.down_proj": mx.array(down),
    }
    want = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    for layout in (per_expert, fused):
        out = stack_experts(layout, experts)
        for proj, w in want.items():
            np.testing.assert_array_equal(np.array(out[f"{block}.switch_mlp.{proj}.weight"]), w)
        assert stack_experts(out, experts).keys() == out.keys()  # stacked: unchanged
    assert stack_experts(per_expert, experts)[f"{block}.switch_mlp.up_proj.scales"].shape == (
        experts,
        hidden,
        1,
    )
    del per_expert[f"{block}.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        stack_experts(per_expert, experts)


# -- loading and serving ----------------------------------------------------------------------


def _greedy_through_engine(folder: Path, prompts: Sequence[list[int]], new: int) -> list[Any]:
    """Serve `folder` (loader -> runner -> engine) and answer `prompts` one after another."""
    loaded = load(folder)
    engine = Engine(ModelRunner(loaded, RunnerSettings(prefill_chunk=16)))
    engine.start()
    try:
        results = []
        for prompt in prompts:
            request = GenerationRequest(tuple(prompt), new, SamplingParams(temperature=0.0))
            events = list(engine.submit(request))
            tokens = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
            finished = events[-1]
            assert isinstance(finished, Finished)
            results.append((tokens, finished.stats.cached_tokens))
        return results
    finally:
        engine.stop()


def _until_eos(tokens: list[int], eos: int = 2) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("name", CACHE_VARIANTS)
def test_loader_serves_tiny_folder_like_transformers(name: str, tiny: TinyModels) -> None:
    hf, folder = tiny[name]
    prompt = _tokens(30, seed=7)[0].tolist()
    follow_up = prompt + _tokens(6, seed=8)[0].tolist()
    (first, _), (second, cached) = _greedy_through_engine(folder, [prompt, follow_up], 8)
    assert first == _until_eos(torch_greedy(hf, prompt, 8))
    assert second == _until_eos(torch_greedy(hf, follow_up, 8))
    assert cached > 0  # the follow-up resumed from the first request's prefix


def _quantize_experts_folder(src: Path, dst: Path) -> None:
    """An mlx-community-style copy of `src`: experts stacked, every 2-D/3-D projection
    4-bit (group 32), the rest float."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    model = build_model(config)
    weights = mx.load(str(src / "model.safetensors"))
    assert isinstance(weights, dict)
    out: dict[str, mx.array] = {}
    for name, value in model.sanitize(weights).items():
        module = name.removesuffix(".weight")
        quantizable = name.endswith("_proj.weight") and value.shape[-1] % 32 == 0
        if quantizable:
            w, s, b = mx.quantize(value, group_size=32, bits=4)
            out.update({name: w, f"{module}.scales": s, f"{module}.biases": b})
        else:
            out[name] = value
    mx.save_safetensors(str(dst / "model.safetensors"), out)
    config["quantization"] = {"group_size": 32, "bits": 4}
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_text((src / name).read_text())


def test_mlx_quantized_moe_folder(tiny: TinyModels, tmp_path: Path) -> None:
    _, folder = tiny["glm4_moe"]
    _quantize_experts_folder(folder, tmp_path / "q")
    kept = load(tmp_path / "q", keep_quantized=True)
    assert kept.quantized
    experts = kept.model.model.layers[1].mlp.switch_mlp  # type: ignore[attr-defined]
    assert isinstance(experts.down_proj, QuantizedSwitchLinear)
    assert experts.down_proj.weight.shape == (16, 64, 32 * 4 // 32)
    params = dict(tree_flatten(kept.model.parameters()))
    assert params["model.layers.1.mlp.switch_mlp.gate_proj.scales"].shape == (16, MOE_HIDDEN, 2)
    dequantized = load(tmp_path / "q", keep_quantized=False)
    assert not dequantized.quantized
    tokens = mx.array(_tokens(24, seed=9))
    np.testing.assert_allclose(
        np.array(kept.model(tokens)), np.array(dequantized.model(tokens)), atol=1e-4, rtol=1e-4
    )
