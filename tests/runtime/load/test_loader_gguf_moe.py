"""GGUF files of the mixture-of-experts architectures llama.cpp defines (qwen3moe, glm4moe,
deepseek2 with sigmoid or softmax gating), written from tiny random transformers models
as convert_hf_to_gguf.py writes them (tests/support/gguf_moe_helpers.py: gguf-py's writer and
tensor name map, experts stacked), load into models whose logits equal transformers' to
1e-4 in float32 over a prefill and decode steps (DeepSeek-V2's routers computing what
llama.cpp computes: tests/support/gguf_moe_cases.py's `llama_cpp_routing`); quantized files load
dequantized, or with their expert stacks still quantized; a file missing what the model
needs, or that it cannot reproduce, is a ValueError naming it."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf.constants import GGMLQuantizationType as QT
from mlx.nn.layers.quantized import QuantizedLinear
from mlx.utils import tree_flatten

from runtime.backend import on_cpu
from runtime.kernels import quantized_ready
from runtime.load.gguf.reader import GGUFFile
from runtime.load.loaded import LoadedModel
from runtime.load.loader import load
from runtime.models.moe import GROUP_MAX, QuantizedSwitchLinear, SparseMoE, SwitchLinear
from tests.support.gguf_helpers import TOKENS
from tests.support.gguf_moe_cases import CASES, build, llama_cpp_routing
from tests.support.gguf_moe_helpers import write_moe_gguf
from tests.support.model_checks import TinyModels, chunked
from tests.support.tiny_models import torch_logits

ATOL = 1e-4
PREFILL = 12  # then the rest of TOKENS one decode step at a time

# what each case's config must say (beyond the dense fields the older tests cover)
_EXPECTED: dict[str, dict[str, Any]] = {
    "qwen3moe": {
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "qwen3moe_tied_bias": {
        "num_experts_per_tok": 3,
        "tie_word_embeddings": True,
        "attention_bias": True,
    },
    "glm4moe": {
        "model_type": "glm4_moe",
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "intermediate_size": 96,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "n_group": 4,
        "topk_group": 2,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    "glm4moe_plain": {
        "num_nextn_predict_layers": 0,
        "norm_topk_prob": False,
        "n_group": 1,
        "partial_rotary_factor": 0.25,
        "rope_theta": 5e4,
        "use_qk_norm": False,
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
    "deepseek2": {
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_interleave": True,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "attention_bias": False,
    },
    "deepseek2_lite_old": {
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "attention_bias": True,
    },
    "deepseek2_kv_b_both": {"q_lora_rank": 32, "qk_nope_head_dim": 16, "v_head_dim": 16},
    "deepseek2_gate_up": {"model_type": "deepseek_v3", "moe_intermediate_size": 32},
    "glm4moe_gate_up": {"model_type": "glm4_moe", "n_routed_experts": 16},
    "deepseek2_v2": {
        "model_type": "deepseek_v2",
        "architectures": ["DeepseekV2ForCausalLM"],
        "scoring_func": "softmax",
        "topk_method": "noaux_tc",
        "num_experts_per_tok": 3,
        "q_lora_rank": 32,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 4.0,
        "first_k_dense_replace": 1,
    },
    "deepseek2_v2_lite_old": {
        "model_type": "deepseek_v2",
        "scoring_func": "softmax",
        "q_lora_rank": None,
        "n_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "attention_bias": True,
    },
}


def _make(name: str, directory: Path) -> Any:
    case = CASES[name]
    model = build(case, directory)
    write_moe_gguf(directory / "model.gguf", case, model, directory)
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """name -> (transformers model, folder with its checkpoint and model.gguf)."""
    return TinyModels(tmp_path_factory, _make)


def _assert_logits(loaded: LoadedModel, model: Any, atol: float = ATOL) -> None:
    """A prefill then decode steps through our caches give transformers' full pass."""
    ours = chunked(loaded.model, TOKENS, [PREFILL, 1])
    with llama_cpp_routing(model):
        want = torch_logits(model, TOKENS)
    np.testing.assert_allclose(ours, want, atol=atol, rtol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_gguf_matches_transformers(written: TinyModels, name: str) -> None:
    model, directory = written[name]
    loaded = load(directory / "model.gguf")
    for key, value in _EXPECTED[name].items():
        assert loaded.config[key] == value, key
    assert (loaded.quantized, loaded.dtype) == (False, "float32")
    _assert_logits(loaded, model)


def test_glm_mtp_blocks_are_in_the_file_but_not_read(written: TinyModels) -> None:
    _, directory = written["glm4moe"]
    tensors = GGUFFile(directory / "model.gguf").tensors
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.ffn_gate_exps.weight"} <= set(tensors)
    loaded = load(directory / "model.gguf")
    assert len(loaded.model.make_caches()) == 3


def test_deepseek2_yarn_is_llama_cpps(written: TinyModels) -> None:
    """yarn_log_multiplier (0.1 * mscale_all_dim) becomes the softmax-scale correction; the
    rotation keeps magnitude 1, as llama.cpp's deepseek2 graph does."""
    _, directory = written["deepseek2"]
    scaling = load(directory / "model.gguf").config["rope_scaling"]
    assert scaling["rope_type"] == "yarn"
    assert (scaling["factor"], scaling["original_max_position_embeddings"]) == (4.0, 128)
    assert scaling["attention_factor"] == 1.0
    assert scaling["mscale_all_dim"] == pytest.approx(0.8)


@pytest.mark.parametrize("quant", [QT.F16, QT.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize(
    "name",
    ["qwen3moe", "glm4moe", "deepseek2_kv_b_both", "deepseek2_v2_lite_old", "deepseek2_gate_up"],
)
def test_quantized_moe_gguf(tmp_path: Path, name: str, quant: QT) -> None:
    """Weights rounded through `quant` first, so the file holds them exactly: dequantized
    on the CPU the logits are transformers'; kept quantized, the expert stacks are one
    quantized gather-matmul each and the routers stay float (and deepseek's whole
    kv_b_proj is read, quantized, rather than its float halves)."""
    case = CASES[name]
    model = build(case, tmp_path, quant=quant)
    path = tmp_path / "model.gguf"
    write_moe_gguf(path, case, model, tmp_path, quant=quant)
    floats = load(path, keep_quantized=False)
    assert floats.quantized is False
    _assert_logits(floats, model)
    kept = load(path, keep_quantized=True, dtype="float32")
    layer = kept.model.model.layers[1].mlp  # type: ignore[attr-defined]
    if quant == QT.F16:
        assert kept.quantized is False and isinstance(layer.switch_mlp.gate_proj, SwitchLinear)
        return
    assert kept.quantized is True
    assert isinstance(layer.switch_mlp.gate_proj, QuantizedSwitchLinear)  # fused: split
    experts = layer.switch_mlp.down_proj
    assert isinstance(experts, QuantizedSwitchLinear)
    assert (experts.bits, experts.group_size, experts.scales.shape) == (
        8,
        32,
        (*experts.weight.shape[:2], 1),
    )
    assert layer.gate.weight.dtype == mx.float32
    if CASES[name].arch == "deepseek2":
        attention = kept.model.model.layers[1].self_attn  # type: ignore[attr-defined]
        assert isinstance(attention.kv_b_proj, QuantizedLinear)
    _assert_logits(kept, model)
    if on_cpu() and quantized_ready():
        # the CPU's default: experts as floats (MLX's CPU gather_qmm is a scalar loop),
        # the rest quantized
        default = load(path)
        mlp = default.model.model.layers[1].mlp  # type: ignore[attr-defined]
        assert isinstance(mlp.switch_mlp.down_proj, SwitchLinear)
        assert default.quantized is True and default.weight_format == "gguf-native"
        _assert_logits(default, model)


def test_fused_gate_up_is_one_tensor_in_the_file(written: TinyModels) -> None:
    """What the _gate_up cases hold (their logits are checked above): each MoE block's
    experts as ffn_gate_up_exps, (experts, gate rows then up rows, embedding)."""
    model, directory = written["glm4moe_gate_up"]
    tensors = GGUFFile(directory / "model.gguf").tensors
    width = model.config.moe_intermediate_size
    fused = tensors["blk.1.ffn_gate_up_exps.weight"]
    assert fused.shape == (model.config.n_routed_experts, 2 * width, model.config.hidden_size)
    assert not {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"} & set(tensors)


def test_router_bias_stays_float32_in_half_precision(written: TinyModels) -> None:
    _, directory = written["glm4moe"]
    loaded = load(directory / "model.gguf", dtype="float16")
    params = dict(tree_flatten(loaded.model.parameters()))
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == mx.float32
    assert params["model.layers.1.mlp.switch_mlp.up_proj.weight"].dtype == mx.float16


# -- what cannot load ------------------------------------------------------------------------

_REQUIRED = [
    ("qwen3moe", "expert_count"),
    ("qwen3moe", "expert_used_count"),
    ("qwen3moe", "expert_feed_forward_length"),
    ("glm4moe", "leading_dense_block_count"),
    ("glm4moe", "expert_shared_count"),
    ("glm4moe", "expert_weights_scale"),
    ("glm4moe", "rope.dimension_count"),
    ("glm4moe", "expert_group_used_count"),
    ("deepseek2", "attention.kv_lora_rank"),
    ("deepseek2", "attention.key_length_mla"),
    ("deepseek2", "rope.dimension_count"),
    ("deepseek2", "expert_feed_forward_length"),
    ("deepseek2", "leading_dense_block_count"),
    ("deepseek2_lite_old", "attention.value_length"),
    ("glm4moe", "feed_forward_length"),
]


def _broken(written: TinyModels, name: str, tmp_path: Path, **kwargs: Any) -> Path:
    model, directory = written[name]
    path = tmp_path / "broken.gguf"
    write_moe_gguf(path, CASES[name], model, directory, **kwargs)
    return path


@pytest.mark.parametrize(("name", "key"), _REQUIRED, ids=[f"{n}-{k}" for n, k in _REQUIRED])
def test_missing_key_is_an_error_naming_it(
    written: TinyModels, tmp_path: Path, name: str, key: str
) -> None:
    path = _broken(written, name, tmp_path, drop_keys=[key])
    with pytest.raises(ValueError, match=re.escape(f"{CASES[name].arch}.{key}")):
        load(path)


def test_deepseek2_gating_picks_the_model(written: TinyModels, tmp_path: Path) -> None:
    """Sigmoid files are deepseek_v3, softmax ones deepseek_v2 (their routers are checked
    against transformers above); other gatings are refused, and so is a softmax file with
    a score-correction bias (a V3 file without its gating key reads as one)."""
    assert load(written["deepseek2"][1] / "model.gguf").config["model_type"] == "deepseek_v3"
    path = _broken(written, "deepseek2", tmp_path, drop_keys=["expert_gating_func"])
    with pytest.raises(ValueError, match=r"blk\.1\.exp_probs_b\.bias: .* softmax routing"):
        load(path)
    other = {"expert_gating_func": 3.0}
    path = _broken(
        written, "deepseek2_v2", tmp_path, drop_keys=["expert_gating_func"], extra_keys=other
    )
    with pytest.raises(ValueError, match=r"expert_gating_func is 3; only softmax or sigmoid"):
        load(path)


@pytest.mark.parametrize("change", [{"group_score": GROUP_MAX}, {"normalize": False}])
def test_deepseek2_softmax_routing_is_llama_cpps(
    written: TinyModels, change: dict[str, Any]
) -> None:
    """llama.cpp scores a softmax file's groups by their two best experts (transformers
    and DeepSeek-V2's code: by the best one) and renormalises when expert_weights_norm
    (transformers' V2 ignores norm_topk_prob): each rule changes this model's logits, so
    matching the llama.cpp oracle checks both."""
    model, directory = written["deepseek2_v2"]
    loaded = load(directory / "model.gguf")
    for layer in loaded.model.model.layers:  # type: ignore[attr-defined]
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.routing = replace(layer.mlp.routing, **change)
    with llama_cpp_routing(model):
        want = torch_logits(model, TOKENS)
    assert not np.allclose(chunked(loaded.model, TOKENS, [PREFILL, 1]), want, atol=ATOL)


def test_deepseek2_rope_attn_factor_is_refused(written: TinyModels, tmp_path: Path) -> None:
    extra = {"rope.scaling.yarn_attn_factor": 0.7}
    path = _broken(written, "deepseek2", tmp_path, extra_keys=extra)
    with pytest.raises(ValueError, match=r"deepseek2\.rope\.scaling\.yarn_attn_factor"):
        load(path)


def test_moe_block_without_router_is_an_error(written: TinyModels, tmp_path: Path) -> None:
    path = _broken(written, "qwen3moe", tmp_path, drop_tensors=["blk.1.ffn_gate_inp.weight"])
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_gate_inp\.weight"):
        load(path)


def test_unknown_moe_tensor_is_an_error(written: TinyModels, tmp_path: Path) -> None:
    # qwen2moe's shared-expert gate: a tensor qwen3moe has no place for
    extra = {"blk.0.ffn_gate_inp_shexp.weight": np.zeros((64,), dtype=np.float32)}
    path = _broken(written, "qwen3moe", tmp_path, extra_tensors=extra)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_inp_shexp\.weight"):
        load(path)


def test_fused_gate_up_with_split_stacks_is_an_error(written: TinyModels, tmp_path: Path) -> None:
    extra = {"blk.1.ffn_up_exps.weight": np.zeros((8, 32, 64), dtype=np.float32)}
    path = _broken(written, "deepseek2_gate_up", tmp_path, extra_tensors=extra)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_gate_up_exps\.weight: .* ffn_up_exps"):
        load(path)


def test_fused_gate_up_with_odd_rows_is_an_error(written: TinyModels, tmp_path: Path) -> None:
    name = "blk.1.ffn_gate_up_exps.weight"
    odd = {name: np.zeros((8, 63, 64), dtype=np.float32)}
    path = _broken(written, "deepseek2_gate_up", tmp_path, drop_tensors=[name], extra_tensors=odd)
    with pytest.raises(ValueError, match=re.escape(f"{name}: shape (8, 63, 64) is not")):
        load(path)
