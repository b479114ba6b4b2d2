"""GLM-4.7-Flash (glm4_moe_lite): tiny random transformers models (query LoRA or not, grouped
routing or not, norm_topk_prob both ways, rope interleaved or in halves, a dense layer
between sparse ones) give transformers' logits over a prefill and decode steps through our
latent caches; each rule that differs from a plain reading is visible at that tolerance
(routing, the score-correction bias, mlp_layer_types); fused experts and zai-org's config
spelling load; config defaults and refusals. (The prefix cache over its latent caches:
tests/runtime/models/test_models_deepseek.py.)"""

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

import transformers

from runtime.cache import LatentCache
from runtime.load.loader import load
from runtime.models import build_model, supported_model_types
from runtime.models.glm4_moe_lite import Model, ModelArgs
from runtime.models.moe import SparseMoE
from tests.support.model_checks import TinyModels, chunked, forward, random_tokens
from tests.support.tiny_deepseek import (
    LAYERS,
    LITE_VARIANTS,
    VOCAB,
    add_mtp_layer,
    make_tiny,
    torch_state,
)
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
    return random_tokens(VOCAB, SEQ, seed=4)


def _ours(model: Model) -> Any:
    return chunked(model, _tokens(), [PREFILL, 1])


def _moe_layers(model: Model) -> list[SparseMoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]


# -- against transformers -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LITE_VARIANTS))
def test_prefill_and_decode_match_transformers(name: str, tiny: TinyModels) -> None:
    hf, directory = tiny[name]
    model = _model(directory)
    assert all(isinstance(c, LatentCache) for c in model.make_caches())
    np.testing.assert_allclose(_ours(model), torch_logits(hf, _tokens()), atol=ATOL, rtol=0)


def test_tiny_models_cover_what_they_claim(tiny: TinyModels) -> None:
    """Guard the oracle's power: the variants exercise the switches they name."""
    model = _model(tiny["glm4_moe_lite"][1])
    args = model.args
    assert args.mlp_layer_types == ("dense", "sparse", "sparse")
    assert [args.is_sparse(i) for i in range(LAYERS)] == [False, True, True]
    assert args.mla.q_lora_rank == 32 and args.mla.rope_interleave
    assert args.mla.rope.theta == 1_000_000.0
    routing = args.routing
    assert (routing.n_group, routing.topk_group, routing.normalize, routing.scaling) == (
        4,
        2,
        True,
        2.5,
    )
    for moe in _moe_layers(model):
        assert float(mx.abs(moe.gate.e_score_correction_bias).min()) > 0
    plain = _model(tiny["glm4_moe_lite_plain"][1]).args
    assert [plain.is_sparse(i) for i in range(LAYERS)] == [True, False, True]
    assert plain.mla.q_lora_rank is None and plain.mla.attention_bias
    assert not plain.mla.rope_interleave and plain.mla.rope.rope_type == "yarn"
    assert plain.mla.scale != plain.mla.qk_head_dim**-0.5  # YaRN's mscale_all_dim
    assert (plain.routing.n_group, plain.routing.normalize, plain.routing.scaling) == (
        1,
        False,
        1.5,
    )
    assert plain.n_shared_experts == 2
    hub = json.loads((tiny["glm4_moe_lite_hub"][1] / "config.json").read_text())
    assert "mlp_layer_types" not in hub and hub["first_k_dense_replace"] == 1
    hub_args = _model(tiny["glm4_moe_lite_hub"][1]).args
    assert hub_args.mlp_layer_types is None
    assert [hub_args.is_sparse(i) for i in range(LAYERS)] == [False, True, True]


def _reroute(model: Model, **changes: Any) -> None:
    for moe in _moe_layers(model):
        moe.routing = replace(moe.routing, **changes)


def _zero_correction_bias(model: Model) -> None:
    for moe in _moe_layers(model):
        bias = moe.gate.e_score_correction_bias
        moe.gate.e_score_correction_bias = mx.zeros_like(bias)


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("glm4_moe_lite", {"n_group": 1}),  # every group eligible
        ("glm4_moe_lite", {"normalize": False}),  # norm_topk_prob ignored
        ("glm4_moe_lite_plain", {"normalize": True}),
        ("glm4_moe_lite", {"scaling": 1.0}),  # routed_scaling_factor ignored
        ("glm4_moe_lite", None),  # e_score_correction_bias ignored
        ("glm4_moe_lite_plain", None),
    ],
    ids=["groups", "normalize", "no_normalize", "scaling", "bias", "bias_plain"],
)
def test_each_routing_rule_shows_in_the_logits(
    name: str, change: dict[str, Any] | None, tiny: TinyModels
) -> None:
    """Mutations: another rule misses transformers' logits on these models, so matching
    them checks each rule."""
    hf, directory = tiny[name]
    model = _model(directory)
    if change is None:
        _zero_correction_bias(model)
    else:
        _reroute(model, **change)
    assert not np.allclose(_ours(model), torch_logits(hf, _tokens()), atol=ATOL)


def test_mlp_layer_types_decide_the_layers(tiny: TinyModels) -> None:
    """Mutation: read without mlp_layer_types (DeepSeek's first_k_dense_replace rule, as
    V3 would), the plain variant's dense middle layer and sparse first layer do not fit
    its weights; the strict load refuses them."""
    _, directory = tiny["glm4_moe_lite_plain"]
    config = json.loads((directory / "config.json").read_text())
    del config["mlp_layer_types"]
    model = build_model(config)
    weights = mx.load(str(directory / "model.safetensors"))
    assert isinstance(weights, dict)
    with pytest.raises(ValueError):
        model.load_weights(list(model.sanitize(weights).items()), strict=True)


# -- checkpoints ----------------------------------------------------------------------------


def test_sanitize_accepts_fused_experts(tiny: TinyModels) -> None:
    """transformers' in-memory layout (experts.gate_up_proj / down_proj, 3-D) loads too."""
    hf, directory = tiny["glm4_moe_lite"]
    state = torch_state(hf)
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    model = build_model(json.loads((directory / "config.json").read_text()))
    assert isinstance(model, Model)
    model.load_weights(list(model.sanitize(state).items()), strict=True)
    tokens = _tokens()
    got = forward(model, tokens, model.make_caches())
    np.testing.assert_allclose(got, torch_logits(hf, tokens), atol=ATOL, rtol=0)


def test_loader_loads_a_hub_folder_and_skips_the_mtp_layer(
    tiny: TinyModels, tmp_path: Path
) -> None:
    """zai-org's config spelling with its multi-token-prediction layer after the decoder."""
    hf, directory = tiny["glm4_moe_lite_hub"]
    folder = tmp_path / "flash"
    shutil.copytree(directory, folder)
    assert "model.layers.3.eh_proj.weight" in add_mtp_layer(folder)
    write_tokenizer(folder, VOCAB, {"eos_token": "w1"})
    loaded = load(folder)
    assert isinstance(loaded.model, Model) and len(loaded.model.model.layers) == LAYERS
    assert loaded.config["model_type"] == "glm4_moe_lite"
    np.testing.assert_allclose(_ours(loaded.model), torch_logits(hf, _tokens()), atol=ATOL, rtol=0)


# -- config reading -------------------------------------------------------------------------


def test_config_defaults_are_glm4_moe_lites() -> None:
    """A config that leaves everything out means Glm4MoeLiteConfig's defaults."""
    want = transformers.Glm4MoeLiteConfig()
    args = ModelArgs.from_config({"model_type": "glm4_moe_lite"})
    mla = args.mla
    assert (args.hidden_size, args.num_layers, args.vocab_size) == (
        want.hidden_size,
        want.num_hidden_layers,
        want.vocab_size,
    )
    assert (mla.num_heads, mla.q_lora_rank, mla.kv_lora_rank) == (
        want.num_attention_heads,
        want.q_lora_rank,
        want.kv_lora_rank,
    )
    assert (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        want.qk_nope_head_dim,
        want.qk_rope_head_dim,
        want.v_head_dim,
    )
    assert (args.intermediate_size, args.moe_intermediate_size) == (
        want.intermediate_size,
        want.moe_intermediate_size,
    )
    assert (args.n_routed_experts, args.num_experts_per_tok, args.n_shared_experts) == (
        want.n_routed_experts,
        want.num_experts_per_tok,
        want.n_shared_experts,
    )
    routing = args.routing
    assert (routing.n_group, routing.topk_group, routing.normalize, routing.scaling) == (
        want.n_group,
        want.topk_group,
        want.norm_topk_prob,
        want.routed_scaling_factor,
    )
    assert (args.max_position_embeddings, args.rms_norm_eps) == (
        want.max_position_embeddings,
        want.rms_norm_eps,
    )
    assert mla.rope_interleave == want.rope_interleave
    layer_types = ["sparse" if args.is_sparse(i) else "dense" for i in range(args.num_layers)]
    assert layer_types == want.mlp_layer_types


def test_registered() -> None:
    assert "glm4_moe_lite" in supported_model_types()
    config = {"model_type": "glm4_moe_lite", "num_hidden_layers": 2, "n_routed_experts": 4}
    config |= {"hidden_size": 64, "num_attention_heads": 2, "vocab_size": 32}
    config |= {"q_lora_rank": 16, "kv_lora_rank": 16, "intermediate_size": 32}
    config |= {"moe_intermediate_size": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4}
    config |= {"v_head_dim": 8}
    assert isinstance(build_model(config), Model)


def _config(**extra: Any) -> dict[str, Any]:
    config = {
        "model_type": "glm4_moe_lite",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "vocab_size": VOCAB,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
    }
    return {**config, **extra}


def test_consistent_spellings_are_accepted() -> None:
    args = ModelArgs.from_config(
        _config(
            head_dim=8,
            partial_rotary_factor=1.0,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            num_local_experts=8,
            n_group=4,
            topk_group=2,
        )
    )
    assert args.n_routed_experts == 8 and args.routing.n_group == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor 0.5",
        ),
        ({"head_dim": 16}, "head_dim 16 differs from qk_rope_head_dim 8"),
        ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        ({"mlp_bias": True}, "mlp_bias is not supported"),
        ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types must name 3 layers"),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must name"),
        (
            {"n_routed_experts": 0, "mlp_layer_types": ["dense", "sparse", "dense"]},
            r"layers \[1\] are sparse but n_routed_experts is 0",
        ),
        ({"n_group": 3, "topk_group": 1}, "n_group 3 and topk_group 1 do not split 8"),
        ({"n_group": 2, "topk_group": 3}, "n_group 2 and topk_group 3"),
    ],
)
def test_what_transformers_cannot_compute_is_refused(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_config(_config(**extra))
