"""HF config fields of the mixture-of-experts architectures llama.cpp defines: ``qwen3moe``,
``glm4moe`` and ``deepseek2``, served by runtime/models' qwen3_moe, glm4_moe, and
deepseek_v3 (sigmoid gating, DeepSeek-V3's files) or deepseek_v2 (softmax gating: V2,
V2-Lite, V2.5, Coder-V2).

llama.cpp's ``{arch}.*`` keys (gguf.constants.Keys) and the HF fields they become:

=====================================  =============================================
expert_count                           num_experts (qwen) / n_routed_experts
expert_used_count                      num_experts_per_tok
expert_feed_forward_length             moe_intermediate_size
expert_shared_count                    n_shared_experts
leading_dense_block_count              first_k_dense_replace
expert_weights_scale                   routed_scaling_factor
expert_weights_norm                    norm_topk_prob
expert_group_count / _used_count       n_group / topk_group
expert_gating_func (1 softmax, 2 sig)  checked: each of our models has one router
                                       (deepseek2: picks deepseek_v2 or deepseek_v3)
nextn_predict_layers                   num_nextn_predict_layers (blocks after the
                                       decoder, counted in block_count; dropped)
rope.dimension_count                   partial_rotary_factor (glm) / qk_rope_head_dim
attention.q_lora_rank / kv_lora_rank   q_lora_rank (absent: no query LoRA) / kv_lora_rank
attention.key_length_mla / value_...   qk_nope_head_dim + qk_rope_head_dim, v_head_dim
=====================================  =============================================

An optional key missing means what llama.cpp's graph for the architecture does without it
(noted where it happens); a key the model needs is a ValueError naming it, and so is a
file whose routing or attention our models cannot reproduce.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.load.gguf.meta import arch_bool, arch_float, arch_int, require_float, require_int
from runtime.load.gguf.reader import GGUFFile

# gguf.constants.ExpertGatingFuncType
SOFTMAX = 1
SIGMOID = 2
_GATING_NAMES = {SOFTMAX: "softmax", SIGMOID: "sigmoid"}
# llama.cpp's deepseek2 converter writes yarn_log_multiplier as 0.1 * HF's mscale_all_dim
_DEEPSEEK_LOG_MUL = 0.1


def _gating(gf: GGUFFile, supported: Sequence[int], default: int) -> int:
    """The file's expert scoring; one our model for this architecture can reproduce."""
    given = arch_int(gf, "expert_gating_func")
    value = default if given is None else given
    if value not in supported:
        name = _GATING_NAMES.get(value, str(value))
        absent = " (llama.cpp's default when the key is absent)" if given is None else ""
        wanted = " or ".join(_GATING_NAMES[s] for s in supported)
        raise ValueError(
            f"{gf.path}: {gf.architecture}.expert_gating_func is {name}{absent}; only "
            f"{wanted} routing is supported for {gf.architecture}"
        )
    return value


def _check_gating(gf: GGUFFile, expected: int, default: int) -> None:
    """Our model for this architecture scores experts one way; the file must agree."""
    _gating(gf, (expected,), default)


def _check_blocks(gf: GGUFFile, sparse: Sequence[bool]) -> None:
    """Every MoE block has its router and every dense block its MLP, as the metadata says
    (else the file would load as a model with other layers than its own)."""
    for index, is_sparse in enumerate(sparse):
        name = f"blk.{index}.{'ffn_gate_inp' if is_sparse else 'ffn_gate'}.weight"
        if name not in gf.tensors:
            kind = "a mixture-of-experts" if is_sparse else "a dense"
            raise ValueError(f"{gf.path}: block {index} should be {kind} layer but has no {name}")


def _dense_width(gf: GGUFFile, config: dict[str, Any], dense_layers: int) -> None:
    """The dense MLP's width: required when some layer is dense, else unused (0)."""
    if dense_layers and config.get("intermediate_size") is None:
        require_int(gf, "feed_forward_length")
    if config.get("intermediate_size") is None:
        config["intermediate_size"] = 0


def _groups(gf: GGUFFile) -> dict[str, int]:
    groups = arch_int(gf, "expert_group_count", 1) or 1
    used = require_int(gf, "expert_group_used_count") if groups > 1 else 1
    return {"n_group": groups, "topk_group": used}


def _experts(gf: GGUFFile) -> dict[str, int]:
    return {
        "num_experts_per_tok": require_int(gf, "expert_used_count"),
        "moe_intermediate_size": require_int(gf, "expert_feed_forward_length"),
    }


def _bias(gf: GGUFFile, tensor: str) -> bool:
    return f"blk.0.{tensor}.bias" in gf.tensors


def qwen3moe(gf: GGUFFile, config: dict[str, Any]) -> None:
    layers = int(config["num_hidden_layers"])
    config.update(
        num_experts=require_int(gf, "expert_count"),
        **_experts(gf),
        # llama.cpp's qwen3moe graph renormalises the top-k weights whatever the file says
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=_bias(gf, "attn_q"),
    )
    _check_gating(gf, SOFTMAX, default=SOFTMAX)
    rotary = arch_int(gf, "rope.dimension_count")
    if rotary is not None and rotary != config["head_dim"]:
        raise ValueError(
            f"{gf.path}: qwen3moe.rope.dimension_count {rotary} != head_dim "
            f"{config['head_dim']}; partial rotary is not supported for qwen3moe"
        )
    _dense_width(gf, config, 0)
    _check_blocks(gf, [True] * layers)


def glm4moe(gf: GGUFFile, config: dict[str, Any]) -> None:
    # block_count counts the multi-token-prediction blocks after the decoder
    nextn = arch_int(gf, "nextn_predict_layers", 0) or 0
    layers = int(config["num_hidden_layers"]) - nextn
    if layers <= 0:
        raise ValueError(f"{gf.path}: glm4moe.nextn_predict_layers {nextn} >= block_count")
    lead = require_int(gf, "leading_dense_block_count")
    head_dim = int(config["head_dim"])
    rotary = require_int(gf, "rope.dimension_count")
    factor = rotary / head_dim
    if rotary > head_dim or int(head_dim * factor) != rotary:
        raise ValueError(
            f"{gf.path}: glm4moe.rope.dimension_count {rotary} for head_dim {head_dim}"
        )
    config.update(
        num_hidden_layers=layers,
        num_nextn_predict_layers=nextn,
        n_routed_experts=require_int(gf, "expert_count"),
        **_experts(gf),
        n_shared_experts=require_int(gf, "expert_shared_count"),
        first_k_dense_replace=lead,
        routed_scaling_factor=require_float(gf, "expert_weights_scale"),
        norm_topk_prob=arch_bool(gf, "expert_weights_norm", False),
        **_groups(gf),
        partial_rotary_factor=factor,
        use_qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
        attention_bias=_bias(gf, "attn_q"),
    )
    _check_gating(gf, SIGMOID, default=SIGMOID)
    _dense_width(gf, config, min(lead, layers))
    _check_blocks(gf, [i >= lead for i in range(layers)])


def _mla_head_dims(gf: GGUFFile) -> tuple[int, int]:
    """(qk_head_dim, v_head_dim). Files in llama.cpp's MLA layout (kv_b_proj split into
    attn_k_b / attn_v_b, 2025 on) give them as *_mla, their key/value_length being the
    latent's; older files give them as key/value_length."""
    mla = "blk.0.attn_k_b.weight" in gf.tensors
    if mla or gf.arch_get("attention.key_length_mla") is not None:
        return require_int(gf, "attention.key_length_mla"), require_int(
            gf, "attention.value_length_mla"
        )
    return require_int(gf, "attention.key_length"), require_int(gf, "attention.value_length")


def _deepseek2_rope(gf: GGUFFile, config: dict[str, Any]) -> None:
    """llama.cpp's deepseek2 YaRN: the rotation keeps magnitude yarn_attn_factor (1 in
    every converted file) and the softmax scale grows by (1 + 0.1 * mscale_all_dim * ln
    factor)^2, the file's yarn_log_multiplier being 0.1 * HF's mscale_all_dim. In HF
    terms: attention_factor 1 (mscale == mscale_all_dim) and that mscale_all_dim."""
    scaling = config.get("rope_scaling")
    if not scaling or scaling.get("rope_type") != "yarn":
        return
    for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor"):
        value = arch_float(gf, key, 1.0)
        if value != 1.0:
            raise ValueError(f"{gf.path}: deepseek2.{key} {value} is not supported (only 1)")
    scaling["attention_factor"] = 1.0
    log_mul = arch_float(gf, "rope.scaling.yarn_log_multiplier", 0.0) or 0.0
    if log_mul:
        scaling["mscale"] = scaling["mscale_all_dim"] = log_mul / _DEEPSEEK_LOG_MUL


def _deepseek2_router(gf: GGUFFile, config: dict[str, Any], lead: int, layers: int) -> None:
    """llama.cpp's one deepseek2 router, whatever the gating: with groups in the file, a
    group scores its two best experts' sum; weights renormalised when
    expert_weights_norm, then scaled. Sigmoid files (DeepSeek-V3's) are deepseek_v3;
    softmax ones (V2's; files from before the key have none, which llama.cpp reads as
    softmax) are deepseek_v2 under topk_method "noaux_tc", its name for these rules
    (transformers' V2 scores a group by its best expert and ignores the norm flag)."""
    gating = _gating(gf, (SOFTMAX, SIGMOID), default=SOFTMAX)
    scale = arch_float(gf, "expert_weights_scale") or 1.0  # absent or 0: llama.cpp's 1
    config.update(
        routed_scaling_factor=scale,
        norm_topk_prob=arch_bool(gf, "expert_weights_norm", False),
        **_groups(gf),
        scoring_func=_GATING_NAMES[gating],
        topk_method="noaux_tc",
    )
    if gating == SIGMOID:
        return
    biased = [i for i in range(lead, layers) if f"blk.{i}.exp_probs_b.bias" in gf.tensors]
    if biased:
        raise ValueError(
            f"{gf.path}: blk.{biased[0]}.exp_probs_b.bias: a score-correction bias on "
            "softmax routing is not supported for deepseek2"
        )
    config.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"])


def deepseek2(gf: GGUFFile, config: dict[str, Any]) -> None:
    heads = int(config["num_attention_heads"])
    rotary = require_int(gf, "rope.dimension_count")
    qk_head, v_head = _mla_head_dims(gf)
    lead = require_int(gf, "leading_dense_block_count")
    layers = int(config["num_hidden_layers"])
    config.update(
        # MLA decompresses to one key/value per head (llama.cpp writes 1: its MQA view)
        num_key_value_heads=heads,
        head_dim=rotary,
        q_lora_rank=arch_int(gf, "attention.q_lora_rank"),
        kv_lora_rank=require_int(gf, "attention.kv_lora_rank"),
        qk_rope_head_dim=rotary,
        qk_nope_head_dim=qk_head - rotary,
        v_head_dim=v_head,
        # llama.cpp rotates deepseek2 in interleaved pairs, as DeepSeek's checkpoints do
        rope_interleave=True,
        attention_bias=_bias(gf, "attn_kv_a_mqa"),
        n_routed_experts=require_int(gf, "expert_count"),
        **_experts(gf),
        n_shared_experts=require_int(gf, "expert_shared_count"),
        first_k_dense_replace=lead,
        moe_layer_freq=1,
    )
    _deepseek2_router(gf, config, lead, layers)
    _deepseek2_rope(gf, config)
    _dense_width(gf, config, min(lead, layers))
    _check_blocks(gf, [i >= lead for i in range(layers)])


# GGUF general.architecture -> its config fields beyond the dense ones
MOE_CONFIGS: Mapping[str, Callable[[GGUFFile, dict[str, Any]], None]] = {
    "qwen3moe": qwen3moe,
    "glm4moe": glm4moe,
    "deepseek2": deepseek2,
}
