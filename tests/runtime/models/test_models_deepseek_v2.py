"""DeepSeek-V2: tiny random transformers models (query LoRA or not, greedy or group-limited
softmax routing, norm_topk_prob off or on) give transformers' logits over a prefill and
decode steps through our latent caches; each routing switch is visible at that
tolerance; the grouped softmax router against numpy; config reading and refusals; the
loader. (The prefix cache over V2's latent caches: tests/runtime/models/test_models_deepseek.py.)"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from mlx.nn.layers.linear import Linear

from runtime.load.loader import load
from runtime.models import build_model, supported_model_types
from runtime.models.deepseek_v2 import Model, ModelArgs
from runtime.models.moe import GROUP_MAX, GROUP_TOP2, SparseMoE, softmax_topk
from tests.support.model_checks import TinyModels, chunked, random_tokens
from tests.support.tiny_deepseek import LAYERS, V2_VARIANTS, VOCAB, make_tiny
from tests.support.tiny_models import load_mlx, torch_logits, write_tokenizer

SEQ = 24
PREFILL = 16  # then the rest one decode step at a time
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make_tiny)


def _model(directory: Path) -> Model:
    model = load_mlx(directory)
    assert isinstance(model, Model)
    return model


def _tokens() -> np.ndarray[Any, Any]:
    return random_tokens(VOCAB, SEQ, seed=2)


def _ours(model: Model) -> Any:
    return chunked(model, _tokens(), [PREFILL, 1])


def _reroute(model: Model, **changes: Any) -> None:
    """Every MoE layer's router with `changes` to its Routing."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.routing = replace(layer.mlp.routing, **changes)


# -- against transformers -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(V2_VARIANTS))
def test_prefill_and_decode_match_transformers(name: str, tiny: TinyModels) -> None:
    hf, directory = tiny[name]
    want = torch_logits(hf, _tokens())
    np.testing.assert_allclose(_ours(_model(directory)), want, atol=ATOL, rtol=0)


def test_tiny_models_cover_what_they_claim(tiny: TinyModels) -> None:
    """Guard the oracle's power: the variants exercise the switches they name."""
    grouped = _model(tiny["deepseek_v2"][1])
    args = grouped.args
    assert [args.is_sparse(i) for i in range(LAYERS)] == [False, True, True]
    assert args.mla.q_lora_rank == 32 and args.mla.rope.rope_type == "yarn"
    assert args.mla.rope_interleave and args.mla.scale != args.mla.qk_head_dim**-0.5
    assert (args.topk_method, args.n_group, args.topk_group) == ("group_limited_greedy", 4, 2)
    routing = args.routing
    assert (routing.group_score, routing.scaling, routing.normalize) == (GROUP_MAX, 4.0, False)
    gate = grouped.model.layers[1].mlp.gate
    assert isinstance(gate, Linear) and "e_score_correction_bias" not in gate
    config = json.loads((tiny["deepseek_v2"][1] / "config.json").read_text())
    assert config["rope_scaling"]["type"] == "yarn" and config["scoring_func"] == "softmax"
    lite = _model(tiny["deepseek_v2_lite"][1]).args
    assert lite.mla.q_lora_rank is None and lite.mla.attention_bias and lite.is_sparse(0)
    assert lite.topk_method == "greedy" and lite.norm_topk_prob
    assert (lite.routing.n_group, lite.routing.normalize, lite.routing.scaling) == (1, False, 1.5)


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("deepseek_v2", {"n_group": 1}),  # greedy instead of group-limited
        ("deepseek_v2", {"group_score": GROUP_TOP2}),  # V3's group score
        ("deepseek_v2", {"scaling": 1.0}),
        ("deepseek_v2_lite", {"normalize": True}),  # norm_topk_prob honoured
    ],
    ids=["groups", "group_score", "scaling", "normalize"],
)
def test_each_routing_rule_shows_in_the_logits(
    name: str, change: dict[str, Any], tiny: TinyModels
) -> None:
    """Another rule would miss transformers' logits on these models, so matching them
    checks each rule (transformers' V2 ignores norm_topk_prob; so does ours)."""
    hf, directory = tiny[name]
    model = _model(directory)
    _reroute(model, **change)
    assert not np.allclose(_ours(model), torch_logits(hf, _tokens()), atol=ATOL)


# -- the router -----------------------------------------------------------------------------


def _np_grouped_softmax(
    logits: np.ndarray[Any, Any], k: int, groups: int, kept: int, by_max: bool, scale: float
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    grouped = probs.reshape(*probs.shape[:-1], groups, -1)
    scores = grouped.max(-1) if by_max else np.sort(grouped, -1)[..., -2:].sum(-1)
    best = np.argsort(-scores, -1)[..., :kept]
    keep = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(keep, best, True, -1)
    choice = np.where(keep[..., None], grouped, -np.inf).reshape(probs.shape)
    ids = np.argsort(-choice, -1)[..., :k]
    return np.take_along_axis(probs, ids, -1) * scale, ids


@pytest.mark.parametrize("group_score", [GROUP_MAX, GROUP_TOP2])
def test_grouped_softmax_router_matches_numpy(group_score: str) -> None:
    logits = np.random.default_rng(3).normal(size=(2, 9, 16)).astype(np.float32) * 2
    weights, ids = softmax_topk(
        mx.array(logits),
        3,
        normalize=False,
        n_group=4,
        topk_group=2,
        group_score=group_score,
        scaling=2.5,
    )
    want_w, want_ids = _np_grouped_softmax(
        logits.astype(np.float64), 3, 4, 2, group_score == GROUP_MAX, 2.5
    )
    order = np.argsort(np.array(ids), -1)  # the router's ids come unordered
    got_ids = np.take_along_axis(np.array(ids), order, -1)
    got_w = np.take_along_axis(np.array(weights), order, -1)
    want_order = np.argsort(want_ids, -1)
    np.testing.assert_array_equal(got_ids, np.take_along_axis(want_ids, want_order, -1))
    np.testing.assert_allclose(got_w, np.take_along_axis(want_w, want_order, -1), rtol=1e-5)


# -- config reading -------------------------------------------------------------------------


def _config(**extra: Any) -> dict[str, Any]:
    config = {
        "model_type": "deepseek_v2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": VOCAB,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    }
    return {**config, **extra}


def test_config_defaults_are_deepseek_v2s() -> None:
    """DeepseekV2Config's defaults (not V3's), greedy routing, rope always interleaved."""
    args = ModelArgs.from_config(_config(rope_interleave=False))
    assert (args.n_routed_experts, args.n_shared_experts, args.first_k_dense_replace) == (64, 2, 0)
    assert (args.routed_scaling_factor, args.moe_intermediate_size) == (1.0, 1407)
    assert args.topk_method == "greedy" and args.routing.n_group == 1
    assert args.mla.rope_interleave and args.model_type == "deepseek_v2"
    # what llama.cpp computes for a softmax GGUF: V3's group score and renormalising
    gguf = ModelArgs.from_config(
        _config(topk_method="noaux_tc", n_group=8, topk_group=3, norm_topk_prob=True)
    )
    assert (gguf.routing.group_score, gguf.routing.normalize) == (GROUP_TOP2, True)
    assert isinstance(build_model(_config()), Model)
    assert "deepseek_v2" in supported_model_types()


def test_norm_topk_prob_under_the_v2_methods_is_said_not_to_apply(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The V2 methods scale and never renormalise: a config asking for it is told so."""
    with caplog.at_level("WARNING", logger="runtime.models.deepseek_v2"):
        args = ModelArgs.from_config(_config(norm_topk_prob=True))
    assert not args.routing.normalize
    assert "norm_topk_prob is true" in caplog.text and "'greedy'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="runtime.models.deepseek_v2"):
        ModelArgs.from_config(
            _config(topk_method="noaux_tc", n_group=8, topk_group=3, norm_topk_prob=True)
        )
        ModelArgs.from_config(_config())
    assert not caplog.text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"topk_method": "noaux_tc_v2"}, "unsupported topk_method 'noaux_tc_v2'"),
        ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not supported"),
        ({"mlp_bias": True}, "mlp_bias is not supported"),
        ({"topk_method": "group_limited_greedy"}, "needs n_group and topk_group"),
        (
            {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1},
            "do not split 64 experts",
        ),
    ],
)
def test_what_transformers_cannot_compute_is_refused(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_config(_config(**extra))


# -- the loader -----------------------------------------------------------------------------


def test_loader_loads_a_v2_folder(tiny: TinyModels, tmp_path: Path) -> None:
    hf, directory = tiny["deepseek_v2"]
    folder = tmp_path / "v2"
    shutil.copytree(directory, folder)
    write_tokenizer(folder, VOCAB, {"eos_token": "w1"})
    loaded = load(folder)
    assert isinstance(loaded.model, Model) and loaded.config["model_type"] == "deepseek_v2"
    np.testing.assert_allclose(_ours(loaded.model), torch_logits(hf, _tokens()), atol=ATOL, rtol=0)
