"""Tiny mixture-of-experts checkpoints (tests/support/gguf_moe_cases.py) written as GGUF the way
llama.cpp's convert_hf_to_gguf.py does it (Qwen3MoeModel, Glm4MoeModel, DeepseekV2Model),
as an oracle independent of our own name mapping: hyperparameters through gguf-py's
GGUFWriter methods, tensor names from gguf-py's TensorNameMap, routed experts stacked per
layer (or gate and up fused in one ``ffn_gate_up_exps``), deepseek's kv_b_proj split
into k_b / v_b, its multi-token-prediction layers skipped.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter, TensorNameMap, get_tensor_name_map
from gguf.constants import (
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    ExpertGatingFuncType,
    RopeScalingType,
)
from gguf.constants import GGMLQuantizationType as QT
from safetensors.numpy import load_file

from tests.support.gguf_helpers import tokenizer_metadata
from tests.support.gguf_moe_cases import MoeCase, quantize

_GATING = {"sigmoid": ExpertGatingFuncType.SIGMOID, "softmax": ExpertGatingFuncType.SOFTMAX}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


# -- tensors: convert_hf_to_gguf.py's modify_tensors ----------------------------------------


def llama_cpp_tensors(case: MoeCase, directory: Path, cfg: Any) -> list[tuple[str, np.ndarray]]:
    """The checkpoint's tensors under HF names as the converter hands them to its name
    map: experts stacked (down, gate, up), e_score_correction_bias renamed, a tied head
    and deepseek's MTP layers dropped, deepseek's kv_b_proj laid out as `case.kv_b`."""
    checkpoint = load_file(str(directory / "model.safetensors"))
    out: list[tuple[str, np.ndarray]] = []
    experts: dict[int, dict[tuple[str, int], np.ndarray]] = defaultdict(dict)
    for name, data in checkpoint.items():
        layer = _LAYER.match(name)
        if case.arch == "deepseek2" and layer and int(layer[1]) >= cfg.num_hidden_layers:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        expert = _EXPERT.match(name)
        if expert is not None:
            experts[int(expert[1])][(expert[3], int(expert[2]))] = data
        elif case.arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            out.extend([(name, data)] if case.kv_b != "split" else [])
            out.extend(_split_kv_b(name, data, cfg) if case.kv_b != "whole" else [])
        else:
            out.append((name, data))
    for bid, parts in sorted(experts.items()):
        count = len(parts) // 3
        stacks = {
            proj: np.stack([parts[(proj, x)] for x in range(count)])
            for proj in ("down_proj", "gate_proj", "up_proj")
        }
        if case.gate_up:  # llama.cpp's fused layout: each expert's gate rows, then up's
            fused = np.concatenate([stacks.pop("gate_proj"), stacks.pop("up_proj")], axis=1)
            out.append((f"model.layers.{bid}.mlp.experts.gate_up_proj", fused))
        for proj, stacked in stacks.items():
            out.append((f"model.layers.{bid}.mlp.experts.{proj}.weight", stacked))
    return out


def _gguf_name(name_map: TensorNameMap, hf: str) -> str:
    """gguf-py's name for `hf`; its map lists the fused experts only for some
    architectures, llama.cpp's loader takes them for these too (create_tensor_gate_up_exps)."""
    gguf_name = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
    fused = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$", hf)
    if gguf_name is None and fused is not None:
        stem = TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_UP_EXP].format(bid=int(fused[1]))
        return f"{stem}.weight"
    if gguf_name is None:
        raise AssertionError(f"gguf-py has no name for {hf}")
    return gguf_name


def _split_kv_b(name: str, data: np.ndarray, cfg: Any) -> list[tuple[str, np.ndarray]]:
    nope, v_head = cfg.qk_nope_head_dim, cfg.v_head_dim
    kv_b = data.reshape(cfg.num_attention_heads, nope + v_head, data.shape[-1])
    k_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
    v_b = np.ascontiguousarray(kv_b[:, nope:])
    return [
        (name.replace("kv_b_proj", "k_b_proj"), k_b),
        (name.replace("kv_b_proj", "v_b_proj"), v_b),
    ]


# -- hyperparameters: the converters' set_gguf_parameters ---------------------------------


def _rope(w: GGUFWriter, rope: Mapping[str, Any]) -> None:
    """TextModel's rope keys (yarn only in these cases)."""
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])


def _common(w: GGUFWriter, cfg: Any, blocks: int, kv_heads: int) -> None:
    w.add_block_count(blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    _rope(w, cfg.rope_parameters)


def _qwen3moe_meta(w: GGUFWriter, cfg: Any) -> None:
    _common(w, cfg, cfg.num_hidden_layers, cfg.num_key_value_heads)
    w.add_expert_count(cfg.num_experts)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _glm4moe_meta(w: GGUFWriter, cfg: Any, nextn: int) -> None:
    _common(w, cfg, cfg.num_hidden_layers + nextn, cfg.num_key_value_heads)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    factor = cfg.rope_parameters.get("partial_rotary_factor", 0.5)
    w.add_rope_dimension_count(int(cfg.head_dim * factor))
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    if nextn:
        w.add_nextn_predict_layers(nextn)


def _deepseek2_meta(w: GGUFWriter, cfg: Any, mla: bool) -> None:
    # MLA files describe the attention as MQA over the latent (one kv head)
    _common(w, cfg, cfg.num_hidden_layers, 1 if mla else cfg.num_attention_heads)
    if cfg.n_group is not None:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    # TextModel writes the gating a config's scoring_func names (DeepSeek-V3's says
    # "sigmoid"); a V2 config without one gives a file without it, as 2024's converter did
    v3 = cfg.model_type == "deepseek_v3"
    scoring = getattr(cfg, "scoring_func", "sigmoid" if v3 else None)
    if scoring is not None:
        w.add_expert_gating_func(_GATING[scoring])
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if mla:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(qk_head)
        w.add_value_length_mla(cfg.v_head_dim)
    else:  # before llama.cpp's MLA: the per-head sizes
        w.add_key_length(qk_head)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    mscale_all = cfg.rope_parameters.get("mscale_all_dim")
    if mscale_all is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all)


def _metadata(case: MoeCase, cfg: Any) -> Callable[[GGUFWriter], None]:
    if case.arch == "qwen3moe":
        return partial(_qwen3moe_meta, cfg=cfg)
    if case.arch == "glm4moe":
        return partial(_glm4moe_meta, cfg=cfg, nextn=int(case.mtp))
    return partial(_deepseek2_meta, cfg=cfg, mla=case.kv_b != "whole")


# -- the file -------------------------------------------------------------------------------


def write_moe_gguf(
    path: Path,
    case: MoeCase,
    model: Any,
    directory: Path,
    *,
    quant: QT = QT.F32,
    drop_keys: Iterable[str] = (),
    extra_keys: Mapping[str, float] | None = None,
    drop_tensors: Iterable[str] = (),
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Write `directory`'s checkpoint as llama.cpp's converter would (``--outtype``
    `quant`); the ``drop_*`` / ``extra_*`` arguments (``{arch}.*`` keys, GGUF tensor
    names) make files it would not write."""
    cfg = model.config
    blocks = cfg.num_hidden_layers + (int(case.mtp) if case.arch == "glm4moe" else 0)
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == case.arch)
    name_map = get_tensor_name_map(arch_id, blocks)
    writer = GGUFWriter(str(path), case.arch)
    _metadata(case, cfg)(writer)
    tokenizer_metadata(writer, cfg.vocab_size)
    for key in drop_keys:
        for kv in writer.kv_data:
            kv.pop(f"{case.arch}.{key}", None)
    for key, value in (extra_keys or {}).items():
        writer.add_float32(f"{case.arch}.{key}", value)
    dropped = set(drop_tensors)
    for hf, data in llama_cpp_tensors(case, directory, cfg):
        gguf_name = _gguf_name(name_map, hf)
        if gguf_name not in dropped:
            _add(writer, gguf_name, data, quant)
    for name, data in (extra_tensors or {}).items():
        _add(writer, name, data, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: GGUFWriter, name: str, data: np.ndarray, quant: QT) -> None:
    """The converter's type choice: vectors, biases and routers F32, the rest `quant`."""
    if data.ndim == 1 or not name.endswith(".weight") or ".ffn_gate_inp." in name:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        return
    values, qtype = quantize(data, quant)
    writer.add_tensor(name, values, raw_dtype=qtype if values.dtype == np.uint8 else None)
