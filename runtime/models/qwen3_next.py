"""Qwen3-Next: a hybrid of gated delta-net layers (linear attention, recurrent state) and
gated full-attention layers, with sparse MoE MLPs (and a sigmoid-gated shared expert).

Also the base of qwen3_5 (runtime/models/qwen3_5.py), which differs only in how its
config nests and how its delta-net projections are laid out.

- Layer pattern: `layer_types` ("linear_attention" / "full_attention"), else every
  `full_attention_interval`-th layer (default 4) is full attention.
- Full attention: q_proj gives each head's query and an output gate side by side; the
  output is multiplied by sigmoid(gate) before o_proj. Per-head q/k RMSNorm, and rotary
  embedding on the first head_dim * `partial_rotary_factor` dims only.
- RMSNorms (layers, final, q/k) scale by (1 + weight) in transformers. We store 1 + weight
  instead, as mlx-community's converted checkpoints do, so plain RMSNorm serves; `sanitize`
  adds the 1 to HF checkpoints, recognised by the HF layout of their conv weights.
- MLP: sparse when num_experts > 0, (i + 1) % decoder_sparse_step == 0 and i is not in
  mlp_only_layers; dense (intermediate_size) otherwise.

Caches: RecurrentCache for delta-net layers, KVCache for attention layers.

The multi-token-prediction layer (``mtp.*``: a full-attention layer, MoE as layer 0 is)
is dropped on load, unless the model drafts with it (`keep_mtp`, `--speculative mtp`:
runtime/models/mtp.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import mlx.core as mx
from mlx.nn.layers.base import Module

from runtime.cache import Cache, KVCache, LayerCache, RecurrentCache, RecurrentState
from runtime.models.base import (
    FULL_ATTENTION,
    MLP,
    CausalLM,
    RMSNorm,
    cache_attention,
    config_float,
    config_int,
)
from runtime.models.decoder import DecoderShape, LayerStack, given_layer_types
from runtime.models.gated_delta import DeltaNetDims, GatedDeltaNet
from runtime.models.linear import Linear
from runtime.models.moe import Routing, SparseMoE, stack_experts
from runtime.models.mtp import MTPHead, check_mtp_weights, mtp_layers, rename_qwen_mtp
from runtime.models.rope import Positions, RoPE, parse_rope

LINEAR_ATTENTION = "linear_attention"
_LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
# norms stored as (1 + weight) once sanitized; the delta-net's gated norm is a plain one
_UNIT_OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_FINAL_NORM = "model.norm.weight"
_T = TypeVar("_T", bound="ModelArgs")


def layer_types(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    given = given_layer_types(config, num_layers)
    if given is not None:
        unknown = set(given) - set(_LAYER_TYPES)
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}")
        return given
    interval = config_int(config, "full_attention_interval", 4)
    return tuple(
        LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)
    )


def _rotary_fraction(config: Mapping[str, Any]) -> float:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return config_float(config, "partial_rotary_factor", 0.25)  # transformers' default


def _delta_dims(config: Mapping[str, Any], hidden: int) -> DeltaNetDims:
    return DeltaNetDims(
        hidden_size=hidden,
        num_k_heads=config_int(config, "linear_num_key_heads", 16),
        num_v_heads=config_int(config, "linear_num_value_heads", 32),
        head_k_dim=config_int(config, "linear_key_head_dim", 128),
        head_v_dim=config_int(config, "linear_value_head_dim", 128),
        conv_kernel=config_int(config, "linear_conv_kernel_dim", 4),
        norm_eps=config_float(config, "rms_norm_eps", 1e-6),
    )


@dataclass(frozen=True)
class ModelArgs(DecoderShape):
    """Attention and delta-net defaults are transformers' (Qwen3NextConfig and
    Qwen3_5TextConfig agree on them); expert counts and sizes must be given (no
    num_experts: dense)."""

    attention_bias: bool
    rotary_dim: int
    linear: DeltaNetDims
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    mtp_layers: int = 0  # the checkpoint's MTP layers (mtp_num_hidden_layers)
    keep_mtp: bool = False  # build and load the first one (runtime/models/mtp.py)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        return cls.parse(config, model_type=str(config.get("model_type", "qwen3_next")))

    @classmethod
    def parse(
        cls: type[_T],
        text: Mapping[str, Any],
        *,
        model_type: str,
        tie_word_embeddings: bool | None = None,
        all_sparse: bool | None = None,
    ) -> _T:
        """Read a (text) config. `all_sparse` fixes which layers are MoE (qwen3_5: the
        model type decides); None applies qwen3_next's decoder_sparse_step rules."""
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        layers = int(text["num_hidden_layers"])
        head_dim = config_int(text, "head_dim", 256)
        experts = config_int(text, "num_experts", 0)
        if all_sparse is None:
            step = config_int(text, "decoder_sparse_step", 1)
            dense_only = {int(i) for i in text.get("mlp_only_layers") or ()}
            sparse = tuple(
                experts > 0 and (i + 1) % step == 0 and i not in dense_only for i in range(layers)
            )
        else:
            sparse = (all_sparse and experts > 0,) * layers
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(text.get("tie_word_embeddings", False))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=config_int(text, "intermediate_size", 0),
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config_int(text, "num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=config_int(text, "max_position_embeddings", 32768),
            rms_norm_eps=config_float(text, "rms_norm_eps", 1e-6),
            tie_word_embeddings=tie_word_embeddings,
            hidden_act=str(text.get("hidden_act", "silu")),
            attention_bias=bool(text.get("attention_bias", False)),
            rope=parse_rope(text),
            rotary_dim=int(head_dim * _rotary_fraction(text)),
            layer_types=layer_types(text, layers),
            linear=_delta_dims(text, hidden),
            num_experts=experts,
            num_experts_per_tok=config_int(text, "num_experts_per_tok", 1),
            moe_intermediate_size=config_int(text, "moe_intermediate_size", 0),
            shared_expert_intermediate_size=config_int(text, "shared_expert_intermediate_size", 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            sparse_layers=sparse,
            mtp_layers=mtp_layers(text),
        )


class GatedAttention(Module):
    """Full attention with a sigmoid output gate, q/k RMSNorm and partial rotary."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dims, bias = args.hidden_size, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.q_proj = Linear(dims, self.n_heads * hd * 2, bias=bias)
        self.k_proj = Linear(dims, self.n_kv_heads * hd, bias=bias)
        self.v_proj = Linear(dims, self.n_kv_heads * hd, bias=bias)
        self.o_proj = Linear(self.n_heads * hd, dims, bias=bias)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps)
        self.k_norm = RMSNorm(hd, args.rms_norm_eps)
        self.rope = RoPE(args.rope, args.rotary_dim)  # rotates the first rotary_dim dims

    def __call__(self, x: mx.array, cache: Cache, positions: Positions | None = None) -> mx.array:
        batch, length, _ = x.shape
        hd = self.head_dim
        # per head: [query | gate]
        query_gate = self.q_proj(x).reshape(batch, length, self.n_heads, 2 * hd)
        q, gate = query_gate[..., :hd], query_gate[..., hd:]
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(batch, length, self.n_kv_heads, hd))
        k = k.transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(batch, length, self.n_kv_heads, hd).transpose(0, 2, 1, 3)
        if positions is None:
            q, k = self.rope(q, cache.offset), self.rope(k, cache.offset)
        else:  # multimodal RoPE: image tokens on their grid, text after images shifted
            q = positions.apply(self.rope, q, cache.offset)
            k = positions.apply(self.rope, k, cache.offset)
        out = cache_attention(q, k, v, cache, scale=hd**-0.5).transpose(0, 2, 1, 3)
        out = out * mx.sigmoid(gate)
        return self.o_proj(out.reshape(batch, length, self.n_heads * hd))


class HybridLayer(Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        dims = args.hidden_size
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if args.layer_types[index] == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(args.linear)
        else:
            self.self_attn = GatedAttention(args)
        self.mlp: MLP | SparseMoE
        if args.sparse_layers[index]:
            self.mlp = SparseMoE(
                dims,
                args.moe_intermediate_size,
                args.num_experts,
                Routing(top_k=args.num_experts_per_tok, normalize=args.norm_topk_prob),
                act=args.hidden_act,
                shared_hidden=args.shared_expert_intermediate_size or None,
                gated_shared=True,
            )
        else:
            self.mlp = MLP(dims, args.intermediate_size, args.hidden_act)
        self.input_layernorm = RMSNorm(dims, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims, args.rms_norm_eps)

    def __call__(
        self, x: mx.array, cache: LayerCache, positions: Positions | None = None
    ) -> mx.array:
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            if not isinstance(cache, RecurrentState):
                raise TypeError(f"a linear-attention layer needs a recurrent cache, not {cache!r}")
            h = self.linear_attn(h, cache)
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, cast(Cache, cache), positions)
        h = x + h
        return h + self.mlp(self.post_attention_layernorm(h))


# -- checkpoints ---------------------------------------------------------------------------


def _split_rows(w: mx.array, groups: int, sizes: Sequence[int]) -> list[mx.array]:
    """Rows of `w` form `groups` groups of [sizes[0] | sizes[1] | ...] rows; return each
    part across the groups (group-major). Works for weights, scales and biases alike."""
    cols = w.shape[-1]
    bounds = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    parts = mx.split(w.reshape(groups, sum(sizes), cols), bounds, axis=1)
    return [p.reshape(-1, cols) for p in parts]


def split_fused_projections(
    weights: dict[str, mx.array], dims: DeltaNetDims
) -> dict[str, mx.array]:
    """qwen3_next's in_proj_qkvz / in_proj_ba -> qwen3_5's in_proj_qkv / _z / _b / _a.

    The fused rows are grouped per key head: [q | k | v | z] with the v and z of that key
    head's value heads, and [b | a] likewise.
    """
    ratio = dims.num_v_heads // dims.num_k_heads
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith(".in_proj_qkvz"):
            base = prefix[: -len("qkvz")]
            sizes = (dims.head_k_dim,) * 2 + (ratio * dims.head_v_dim,) * 2
            q, k, v, z = _split_rows(value, dims.num_k_heads, sizes)
            out[f"{base}qkv.{kind}"] = mx.concatenate([q, k, v], axis=0)
            out[f"{base}z.{kind}"] = z
        elif prefix.endswith(".in_proj_ba"):
            base = prefix[: -len("ba")]
            b, a = _split_rows(value, dims.num_k_heads, (ratio, ratio))
            out[f"{base}b.{kind}"], out[f"{base}a.{kind}"] = b, a
        else:
            out[name] = value
    return out


def _from_hf_layout(weights: Mapping[str, mx.array]) -> bool:
    """HF checkpoints store the conv as (C, 1, K); converted ones (and ours) as (C, K, 1).
    Without a delta-net layer there is nothing to tell by: HF is assumed."""
    convs = [v for k, v in weights.items() if k.endswith("conv1d.weight")]
    return not convs or any(v.shape[-1] != 1 for v in convs)


def sanitize_hybrid(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """Text-model names (``model.``, ``lm_head.``) -> parameters. Idempotent: the loader
    may run it twice (quantized folders)."""
    hf = _from_hf_layout(weights)
    # the multi-token-prediction head: dropped unless kept to draft with
    weights = rename_qwen_mtp(weights, keep=args.keep_mtp, unit_offset=lambda _: hf)
    if args.keep_mtp:
        check_mtp_weights(weights, args.model_type)
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if "rotary_emb.inv_freq" in name:
            continue
        if hf and name.endswith("conv1d.weight"):
            value = value.swapaxes(1, 2)
        elif hf and (name.endswith(_UNIT_OFFSET_NORMS) or name == _FINAL_NORM):
            value = value + 1.0
        out[name] = value
    if args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return stack_experts(out, args.num_experts) if args.num_experts else out


class Model(CausalLM):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, LayerStack(args, lambda i: HybridLayer(args, i)))
        if args.keep_mtp:  # one full-attention layer, sparse as layer 0 is
            one = dataclasses.replace(
                args, layer_types=(FULL_ATTENTION,), sparse_layers=args.sparse_layers[:1]
            )
            block = HybridLayer(one, 0)
            self.mtp = MTPHead(args.hidden_size, args.rms_norm_eps, block, pass_normed=True)

    def mtp_head(self) -> MTPHead | None:
        return self.mtp if self.args.keep_mtp else None

    def mtp_cache(self) -> Cache:
        return KVCache()

    def make_caches(self) -> list[Cache]:
        """RecurrentCache for delta-net layers, KVCache for attention layers.

        The LanguageModel protocol types caches as attention `Cache`s; the recurrent ones
        satisfy the `LayerCache` part every consumer (generate, prefix cache) uses.
        """
        caches: list[LayerCache] = [
            RecurrentCache() if kind == LINEAR_ATTENTION else KVCache()
            for kind in self.args.layer_types
        ]
        return cast(list[Cache], caches)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return sanitize_hybrid(split_fused_projections(weights, self.args.linear), self.args)
