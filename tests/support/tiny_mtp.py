"""Tiny models with a multi-token-prediction layer, in the layouts the checkpoints ship:
DeepSeek-V3's and GLM-4.5's (``model.layers.<num_hidden_layers>.*``) and Qwen3-Next's
and Qwen3.5's (``mtp.*``), added to the tiny random transformers models of
tests/support/tiny_deepseek.py, tiny_moe.py and tiny_hybrid.py (transformers has no
MTP: the layer's weights are made here).

`agree=True` arranges the weights so that the head predicts what the target writes: the
target's layers are zeroed (its output at position i depends on the token there alone:
norm(embed(x_i)), then its LM head), and the head passes the next token's normed
embedding straight through (its projection takes the embedding half, its block adds
nothing) to the target's final norm and LM head, so both pick the same argmax; the
special tokens (end of generation among them) are never the argmax.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tests.support.tiny_deepseek as tiny_deepseek
import tests.support.tiny_hybrid as tiny_hybrid
import tests.support.tiny_models as tiny_models
import tests.support.tiny_moe as tiny_moe

# name -> (module that builds the target, its vocabulary)
TARGETS = {
    "deepseek_v3": (tiny_deepseek, tiny_deepseek.VOCAB),
    "qwen3_next": (tiny_hybrid, tiny_hybrid.VOCAB),
    "glm4_moe": (tiny_moe, tiny_moe.VOCAB),  # DeepSeek's layout over GQA attention
    "qwen3_5_text": (tiny_hybrid, tiny_hybrid.VOCAB),  # Qwen3-Next's layout, dense
}


def make_tiny_mtp(
    name: str,
    directory: Path,
    *,
    seed: int = 3,
    agree: bool = False,
    attend: float = 1.0,
    noise: float = 0.0,
) -> Path:
    """Write the `name` target with its MTP layer (and a tokenizer) into `directory`;
    `attend` scales the head's attention output (a head whose prediction hangs on the
    context it attends to, where the random block's attention adds little); `noise`
    moves its projection (with `agree`: a head near the target, not equal to it)."""
    module, vocab = TARGETS[name]
    module.make_tiny(name, directory, seed=seed)
    tiny_models.write_tokenizer(directory, vocab)
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((directory / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed + 100)
    if not name.startswith("qwen"):
        extra = _deepseek_layer(tensors, config["num_hidden_layers"], gen, agree)
        config["num_nextn_predict_layers"] = 1
    else:
        extra = _qwen_layer(tensors, config, gen, agree)
        config["mtp_num_hidden_layers"] = 1
    extra = {k: v * attend if "self_attn.o_proj." in k else v for k, v in extra.items()}
    for k, v in extra.items():
        if k.endswith(("eh_proj.weight", "mtp.fc.weight")) and noise:
            extra[k] = v + torch.randn(v.shape, generator=gen) * noise
    if agree:
        tensors = {k: _zero(v) if k.startswith("model.layers.") else v for k, v in tensors.items()}
        head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
        tensors[head] = tensors[head].clone()
        tensors[head][:3] = 0.0  # the special tokens never win: rows run to max_tokens
    save_file({**tensors, **extra}, str(path), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _zero(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t)


def _noisy(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Another layer's weight, moved: the head's block is not a copy of the target's."""
    return t + torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.05


def _projection(hidden: int, gen: torch.Generator, agree: bool) -> torch.Tensor:
    """(hidden, 2 * hidden) over [embedding | hidden state]."""
    if agree:
        return torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    return torch.randn(hidden, 2 * hidden, generator=gen) * 0.15


def _deepseek_layer(
    tensors: dict[str, torch.Tensor], layers: int, gen: torch.Generator, agree: bool
) -> dict[str, torch.Tensor]:
    """DeepSeek's (and GLM's) nextn layer: the last layer's block (MoE), enorm, hnorm, eh_proj,
    shared_head.{norm, head} and a copy of the embeddings."""
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    block = {mtp + k[len(last) :]: v for k, v in tensors.items() if k.startswith(last)}
    out = {k: _zero(v) if agree else _noisy(v, gen) for k, v in block.items()}
    hidden = tensors["model.norm.weight"].shape[0]
    out[mtp + "eh_proj.weight"] = _projection(hidden, gen, agree)
    for norm in ("enorm", "hnorm"):
        spread = torch.rand(hidden, generator=gen) + 0.5
        out[f"{mtp}{norm}.weight"] = torch.ones(hidden) if agree else spread
    final = tensors["model.norm.weight"]
    out[mtp + "shared_head.norm.weight"] = final.clone() if agree else _noisy(final, gen)
    out[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    out[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    return out


def _qwen_layer(
    tensors: dict[str, torch.Tensor], config: dict[str, object], gen: torch.Generator, agree: bool
) -> dict[str, torch.Tensor]:
    """Qwen3-Next's ``mtp.*``: a full-attention layer's attention and norms with layer
    0's (sparse) MLP, fc, and the three norms, stored as offsets from 1 as HF does."""
    types = config.get("layer_types")
    full = types.index("full_attention") if isinstance(types, list) else 1
    attn, first = f"model.layers.{full}.", "model.layers.0."
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        if k.startswith(attn) and ".mlp." not in k:
            out["mtp.layers.0." + k[len(attn) :]] = v
        elif k.startswith(first + "mlp."):
            out["mtp.layers.0." + k[len(first) :]] = v
    out = {k: _zero(v) if agree else _noisy(v, gen) for k, v in out.items()}
    hidden = tensors["model.norm.weight"].shape[0]
    out["mtp.fc.weight"] = _projection(hidden, gen, agree)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):  # 0: a scale of 1
        out[f"mtp.{norm}.weight"] = (
            torch.zeros(hidden) if agree else torch.randn(hidden, generator=gen) * 0.2
        )
    final = tensors["model.norm.weight"]
    out["mtp.norm.weight"] = final.clone() if agree else _noisy(final, gen)
    return out
