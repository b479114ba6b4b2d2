"""GGUF tensor names of the mixture-of-experts architectures (qwen3moe, glm4moe, deepseek2)
and their HF (runtime/models) parameter names; runtime/load/gguf/names.py applies them.

- Routed experts are stored stacked, ``ffn_{gate,up,down}_exps`` of shape
  (experts, out, in): exactly the ``switch_mlp`` arrays runtime/models/moe.py holds, so
  they load as they are (and, kept quantized, become one quantized stack).
- Newer conversions may fuse gate and up into ``ffn_gate_up_exps``, ggml shape
  {n_embd, 2 * n_ff_exp, n_expert}, numpy (experts, 2 * n_ff_exp, n_embd): llama.cpp's
  build_moe_ffn multiplies once and views the first n_ff_exp outputs as gate, the rest
  as up (create_tensor_gate_up_exps reads no ffn_gate_exps / ffn_up_exps then). It is
  named ``switch_mlp.gate_up_proj`` here and split in two by runtime/load/gguf/decode.py.
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

import re
from collections.abc import Iterable, Mapping

# per-block part -> HF module (names of gguf-py's MODEL_TENSOR table); none collides
# with a dense architecture's
MOE_BLOCK_NAMES: Mapping[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_gate_up_exps": "mlp.switch_mlp.gate_up_proj",  # split at load (GATE_UP)
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


# the fused experts' HF name, and the two it is split into (gate rows first)
GATE_UP = ".switch_mlp.gate_up_proj.weight"
GATE_UP_PARTS = (".switch_mlp.gate_proj.weight", ".switch_mlp.up_proj.weight")
_BLOCK_PART = re.compile(r"^blk\.(\d+)\.(ffn_gate_up_exps|ffn_gate_exps|ffn_up_exps)\.weight$")


def check_gate_up(shapes: Mapping[str, tuple[int, ...]]) -> None:
    """A block's experts are fused (``ffn_gate_up_exps``) or split, never both (llama.cpp
    would not read the split ones), and fused ones have an even number of rows per
    expert. ``shapes``: GGUF tensor name -> numpy shape."""
    parts: dict[str, set[str]] = {}
    for name, shape in shapes.items():
        match = _BLOCK_PART.match(name)
        if match is None:
            continue
        parts.setdefault(match[1], set()).add(match[2])
        if match[2] == "ffn_gate_up_exps" and (len(shape) != 3 or shape[1] % 2):
            raise ValueError(
                f"{name}: shape {shape} is not (experts, 2 * expert width, embedding) "
                "(gate and up rows of each expert)"
            )
    for block, names in parts.items():
        if "ffn_gate_up_exps" in names and len(names) > 1:
            raise ValueError(
                f"blk.{block}.ffn_gate_up_exps.weight: the block also has "
                f"{', '.join(sorted(names - {'ffn_gate_up_exps'}))}; the experts' gate and "
                "up must come either fused or split"
            )


_HALVES = (".embed_q.weight", ".unembed_out.weight")


def redundant(names: Iterable[str]) -> set[str]:
    """The split kv_b_proj halves of attention layers that also have the whole matrix:
    the whole one is the original (and can stay quantized as a Linear), the halves were
    derived from it."""
    names = list(names)
    whole = {n.removesuffix(".kv_b_proj.weight") for n in names if n.endswith(".kv_b_proj.weight")}
    return {n for n in names if n.endswith(_HALVES) and n.rsplit(".", 2)[0] in whole}
