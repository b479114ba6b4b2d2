"""Multi-token prediction (MTP) heads: the extra layer DeepSeek-V3, GLM-4.x, Qwen3-Next
and Qwen3.5 checkpoints ship after the decoder, which predicts the token after next.

At position i the head reads the target's hidden state h_i (the decoder's output after
its final norm, as vLLM and SGLang feed it) and the embedding of the token at i + 1 (the
target's own embeddings), each RMS-normed, projects their concatenation [embedding |
hidden] back to the model width, runs one decoder block over its own cache (full
attention, MoE where the model's later layers are) and normalizes: the target's LM head
turns that into the distribution of the token at i + 2.

Drafting k tokens runs the head on its own output (runtime/batch/mtp.py): the hidden
state it passes on is its block's output (DeepSeek's layout: before its final norm) or
the normed one (Qwen's: its `mtp.norm` output), as the reference implementations do.

Checkpoint names, renamed to this module's by each model's `sanitize`:
- DeepSeek-V3 / GLM-4.x: ``model.layers.<num_hidden_layers>.{enorm, hnorm, eh_proj,
  shared_head.norm}`` and the block's own names; ``shared_head.head`` and
  ``embed_tokens`` repeat the target's LM head and embeddings and are not kept.
- Qwen3-Next / Qwen3.5: ``mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}``
  and ``mtp.layers.0.*``.

The weights are kept only when the server drafts with them (`--speculative mtp`);
otherwise every loader drops them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import mlx.core as mx
from mlx.nn.layers.base import Module

from runtime.cache import Cache
from runtime.models.base import RMSNorm
from runtime.models.linear import Linear

# the config keys that count a checkpoint's MTP layers (DeepSeek and GLM; Qwen)
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
_A = TypeVar("_A")


def mtp_layers(config: Mapping[str, Any]) -> int:
    """How many MTP layers a config says its checkpoint has (0: none)."""
    text = config.get("text_config")
    for cfg in (config, text if isinstance(text, Mapping) else {}):
        for key in MTP_CONFIG_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def keeping_mtp(args: _A) -> _A:
    """`args` (a ModelArgs with `mtp_layers` and `keep_mtp`) that keep the MTP layer; a
    ValueError naming the model type when its config has none."""
    if not getattr(args, "mtp_layers", 0):
        model_type = getattr(args, "model_type", "this")
        raise ValueError(
            f"--speculative mtp: the {model_type} model has no multi-token-prediction "
            "layers (its config names none); choose --speculative lookup, trie or draft"
        )
    return dataclasses.replace(args, keep_mtp=True)  # type: ignore[type-var]


class MTPHead(Module):
    """One MTP layer (see the module docstring); `block(x, cache)` is a decoder layer."""

    def __init__(self, dims: int, eps: float, block: Module, *, pass_normed: bool) -> None:
        super().__init__()
        self.enorm = RMSNorm(dims, eps)
        self.hnorm = RMSNorm(dims, eps)
        self.eh_proj = Linear(2 * dims, dims, bias=False)
        self.block = block
        self.norm = RMSNorm(dims, eps)
        self._pass_normed = pass_normed

    def __call__(
        self, hidden: mx.array, embedded: mx.array, cache: Cache
    ) -> tuple[mx.array, mx.array]:
        """(B, L, D) hidden states at positions i and the embeddings of the tokens at
        i + 1 -> (the hidden state a further step reads, the normed output the LM head
        reads), both (B, L, D)."""
        x = self.eh_proj(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))
        out: mx.array = self.block(x, cache)
        normed = self.norm(out)
        return (normed if self._pass_normed else out), normed


@runtime_checkable
class MTPModel(Protocol):
    """A model that may carry its MTP head (loaded with `keep_mtp`)."""

    def mtp_head(self) -> MTPHead | None: ...

    def mtp_cache(self) -> Cache: ...


def rename_nextn(weights: Mapping[str, mx.array], layer: int, *, keep: bool) -> dict[str, mx.array]:
    """DeepSeek's and GLM's layout: the tensors of ``model.layers.<layer>.`` as this
    module's ``mtp.`` names when `keep`, the copies of the target's LM head and
    embeddings dropped; other names unchanged (the decoder's sanitize drops the layer
    when not kept)."""
    if not keep:
        return dict(weights)
    prefix = f"model.layers.{layer}."
    own = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.",
           "shared_head.norm.": "norm."}  # fmt: skip
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if not name.startswith(prefix):
            out[name] = value
            continue
        rest = name[len(prefix) :]
        if rest.startswith(("shared_head.head.", "embed_tokens.")):
            continue
        mapped = next((new + rest[len(old) :] for old, new in own.items()
                       if rest.startswith(old)), None)  # fmt: skip
        out["mtp." + (mapped if mapped is not None else "block." + rest)] = value
    return out


def rename_qwen_mtp(
    weights: Mapping[str, mx.array], *, keep: bool, unit_offset: Callable[[str], bool]
) -> dict[str, mx.array]:
    """Qwen3-Next's and Qwen3.5's layout: ``mtp.*`` as this module's names when `keep`
    (dropped otherwise). `unit_offset(name)`: whether a norm's weight is stored as an
    offset from 1 (HF checkpoints), which gets the 1 added as the decoder's norms do."""
    own = {"mtp.pre_fc_norm_embedding.": "mtp.enorm.", "mtp.pre_fc_norm_hidden.": "mtp.hnorm.",
           "mtp.fc.": "mtp.eh_proj.", "mtp.layers.0.": "mtp.block."}  # fmt: skip
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if not name.startswith("mtp."):
            out[name] = value
            continue
        if not keep or (name.startswith("mtp.layers.") and not name.startswith("mtp.layers.0.")):
            continue  # (one MTP layer drafts; later ones are not read)
        renamed = next((new + name[len(old) :] for old, new in own.items()
                        if name.startswith(old)), name)  # fmt: skip
        if renamed in ("mtp.enorm.weight", "mtp.hnorm.weight", "mtp.norm.weight") and unit_offset(
            name
        ):
            value = value + 1.0
        out[renamed] = value
    return out


def check_mtp_weights(weights: Mapping[str, mx.array], model_type: str) -> None:
    """A ValueError when MTP layers were asked for and the checkpoint has none (a
    conversion may drop them while its config still names them)."""
    if not any(name.startswith("mtp.") for name in weights):
        raise ValueError(
            f"--speculative mtp: this {model_type} checkpoint has no multi-token-prediction "
            "weights (its config names them, its files do not: conversions often drop "
            "them); serve the original checkpoint, or choose another --speculative mode"
        )
