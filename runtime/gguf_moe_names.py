"""GGUF tensor names of the mixture-of-experts architectures (qwen3moe, glm4moe, deepseek2)
and their HF (runtime/models) parameter names; runtime/gguf_names.py applies them.

- Routed experts are stored stacked, ``ffn_{gate,up,down}_exps`` of shape
  (experts, out, in): exactly the ``switch_mlp`` arrays runtime/models/moe.py holds, so
  they load as they are (and, kept quantized, become one quantized stack).
- Shared experts are ``ffn_*_shexp``, the router ``ffn_gate_inp`` and its score-correction
  bias ``exp_probs_b.bias``.
- deepseek2's multi-head latent attention: ``attn_q_a`` / ``attn_q_a_norm`` /
  ``attn_q_b`` (or ``attn_q``), ``attn_kv_a_mqa`` / ``attn_kv_a_norm``, and ``kv_b_proj``
  either whole (``attn_kv_b``, files before llama.cpp's MLA) or split into ``attn_k_b``
  (heads, kv_lora_rank, qk_nope) and ``attn_v_b`` (heads, v_head, kv_lora_rank): mlx-lm's
  ``embed_q`` / ``unembed_out``, which the model's sanitize fuses back into kv_b_proj.
  Files from the transition carry both; the whole one is read (see `redundant`).

For these architectures a tensor with no HF name is an error rather than a warning: a
dropped shared expert or router bias would still load, as a different model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# per-block part -> HF module (names of gguf-py's MODEL_TENSOR table); none collides
# with a dense architecture's
MOE_BLOCK_NAMES: Mapping[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.embed_q",
    "attn_v_b": "self_attn.unembed_out",
}

# per-block part.kind -> whole HF parameter name (the bias is a parameter of its own)
MOE_FULL_NAMES: Mapping[str, str] = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}

# architectures whose unnamed tensors are an error
STRICT_ARCHS = frozenset({"qwen3moe", "glm4moe", "deepseek2"})

# MoE routers' score-correction biases stay float32, as transformers keeps them: in a
# lower precision they can swap which expert wins a near-tie
FLOAT32_SUFFIX = "e_score_correction_bias"


_HALVES = (".embed_q.weight", ".unembed_out.weight")


def redundant(names: Iterable[str]) -> set[str]:
    """The split kv_b_proj halves of attention layers that also have the whole matrix:
    the whole one is the original (and can stay quantized as a Linear), the halves were
    derived from it."""
    names = list(names)
    whole = {n.removesuffix(".kv_b_proj.weight") for n in names if n.endswith(".kv_b_proj.weight")}
    return {n for n in names if n.endswith(_HALVES) and n.rsplit(".", 2)[0] in whole}
