"""Tensor parallelism for every mixer and MLP the runtime's architectures are built from.

One rule per module type (the layers of every architecture are made of these). No count
has to divide the group size: heads go to ranks contiguously and as evenly as possible,
widths as evenly as whole quantization groups allow (runtime/distributed/layers.py).

- `Attention` (llama, qwen2, qwen3, gemma3, qwen3_moe, glm4_moe): each rank keeps its
  query heads and the key/value heads they read (a key/value head whose query heads
  straddle two ranks is held by both); where a rank's heads read their key/value heads
  unequally, heads of zeros pad them to grouped-query attention's uniform layout
  (`split_heads`). q/k/v keep their rows; o_proj is row-parallel over the same heads.
- `GatedAttention` (qwen3_next, qwen3_5): the same, q_proj's rows being each head's
  query and output gate side by side.
- `MultiLatentAttention` (deepseek_v3, deepseek_v2, glm4_moe_lite): heads split (q_proj
  or q_b_proj, kv_b_proj rows; o_proj row-parallel). The latent and the rotary key are
  shared by all heads, so q_a_proj, kv_a_proj_with_mqa and their norms stay whole and
  every rank caches the whole latent (576 numbers a token for DeepSeek-V3: the cache MLA
  already shrank).
- `GatedDeltaNet` (qwen3_next, qwen3_5): value heads split, each rank keeping the key
  heads its value heads read (repeated where they read them unequally: a value head
  carries a recurrent state, so it is never padded); the conv's channels, in_proj_qkv's
  q, k and v rows, z, b, a, dt_bias and A_log follow their heads, so each rank's
  recurrent state holds its heads.
- `MLP`: gate/up columns split, down_proj row-parallel.
- `SparseMoE`: experts spread over the ranks (contiguous ranges); every rank routes
  every token over all experts, runs the chosen ones it holds (others are sent to one
  of its experts with weight zero, so a decode step reads about k/size + 1 experts a
  rank), and one all_sum per layer adds the ranks' parts. Shared experts split like an
  MLP and join that same all_sum.

`tensor_problems` lists what cannot split before anything changes (more ranks than
heads, than experts or than an MLP's width; quantized inputs that would not fall on whole
quantization groups), so a model that cannot be split is left whole and the error
names every count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module

from runtime.distributed.layers import (
    HeadSplit,
    Index,
    balanced_range,
    columns_problem,
    head_problem,
    head_rows,
    out_features,
    quantization_unit,
    row_parallel,
    slice_rows,
    span,
    split_heads,
    take_columns,
    take_rows,
)
from runtime.models.base import MLP, Attention
from runtime.models.gated_delta import GatedDeltaNet
from runtime.models.mla import MultiLatentAttention
from runtime.models.moe import SparseMoE
from runtime.models.qwen3_next import GatedAttention

# the attributes of a decoder layer that hold its token mixer and its MLP
LAYER_PARTS = ("self_attn", "linear_attn", "mlp")
_ATTENTION_NAMES = ("num_attention_heads", "num_key_value_heads")
_DELTA_NAMES = ("linear_num_value_heads", "linear_num_key_heads")


# -- what each rank holds ------------------------------------------------------------------
# (the checks and the rules below read the same functions, so what is checked is what
# is done)


def _attention_heads(attn: Attention | GatedAttention, size: int, rank: int) -> HeadSplit:
    return split_heads(attn.n_heads, attn.n_kv_heads, size, rank, pad=True)


def _attention_columns(attn: Attention | GatedAttention, size: int, rank: int) -> Index:
    return head_rows(_attention_heads(attn, size, rank).slots, attn.head_dim)


def _mla_heads(attn: MultiLatentAttention, size: int, rank: int) -> tuple[int, int]:
    return balanced_range(attn.cfg.num_heads, size, rank)


def _mla_columns(attn: MultiLatentAttention, size: int, rank: int) -> Index:
    start, stop = _mla_heads(attn, size, rank)
    return span(start * attn.cfg.v_head_dim, stop * attn.cfg.v_head_dim)


def _delta_heads(net: GatedDeltaNet, size: int, rank: int) -> HeadSplit:
    d = net.dims
    return split_heads(d.num_v_heads, d.num_k_heads, size, rank, pad=False)


def _delta_columns(net: GatedDeltaNet, size: int, rank: int) -> Index:
    return head_rows(_delta_heads(net, size, rank).slots, net.dims.head_v_dim)


def _mlp_rows(mlp: MLP, size: int, rank: int) -> tuple[int, int]:
    """gate/up rows and down_proj inputs: whole quantization groups of down_proj."""
    return balanced_range(out_features(mlp.gate_proj), size, rank, quantization_unit(mlp.down_proj))


# -- checks --------------------------------------------------------------------------------


def _columns_problem(
    linear: Module, size: int, columns: Callable[[int], Index], label: str
) -> str | None:
    """The first rank whose row-parallel inputs `linear` cannot take (quantized groups)."""
    for rank in range(size):
        problem = columns_problem(linear, columns(rank), label)
        if problem:
            return problem
    return None


def _mlp_problems(mlp: MLP, size: int, label: str) -> list[str]:
    width, unit = out_features(mlp.gate_proj), quantization_unit(mlp.down_proj)
    if width % unit:
        return [f"{label} {width} is not a multiple of the quantization group size {unit}"]
    if width // unit < size:
        what = "columns" if unit == 1 else f"quantization groups of {unit}"
        return [f"{label} {width} has only {width // unit} {what} for {size} ranks"]
    return []


def _moe_problems(moe: SparseMoE, size: int) -> list[str]:
    problems = []
    experts = int(moe.switch_mlp.gate_proj["weight"].shape[0])
    if experts < size:
        problems.append(f"{experts} experts cannot be spread over {size} ranks")
    for shared in (moe.shared_experts, moe.shared_expert):
        if shared is not None:
            problems += _mlp_problems(shared, size, "shared expert intermediate size")
            if "bias" in shared.down_proj:
                problems.append("a shared expert with a down_proj bias is not supported")
    return problems


def _module_problems(module: Any, size: int) -> list[str]:
    out: list[str | None] = []
    if isinstance(module, (Attention, GatedAttention)):
        problem = head_problem(module.n_heads, module.n_kv_heads, size, _ATTENTION_NAMES)
        columns = partial(_attention_columns, module, size)
        out += [problem or _columns_problem(module.o_proj, size, columns, "o_proj")]
    elif isinstance(module, MultiLatentAttention):
        count = module.cfg.num_heads
        problem = head_problem(count, count, size, ("num_attention_heads", "heads"))
        columns = partial(_mla_columns, module, size)
        out += [problem or _columns_problem(module.o_proj, size, columns, "o_proj")]
    elif isinstance(module, GatedDeltaNet):
        d = module.dims
        problem = head_problem(d.num_v_heads, d.num_k_heads, size, _DELTA_NAMES)
        columns = partial(_delta_columns, module, size)
        label = "linear attention out_proj"
        out += [problem or _columns_problem(module.out_proj, size, columns, label)]
    elif isinstance(module, SparseMoE):
        out += _moe_problems(module, size)
    elif isinstance(module, MLP):
        out += _mlp_problems(module, size, "intermediate_size")
    else:
        out.append(f"no tensor-parallel rule for {type(module).__name__}")
    return [p for p in out if p]


def layer_parts(layers: list[Any]) -> Iterator[tuple[Any, str, Any]]:
    """(layer, attribute, module) for every mixer and MLP of `layers`."""
    for layer in layers:
        for name in LAYER_PARTS:
            module = getattr(layer, name, None)
            if isinstance(module, Module):
                yield layer, name, module


def tensor_problems(layers: list[Any], size: int) -> list[str]:
    """Everything that keeps `layers` from splitting over `size` ranks (each reason once)."""
    seen: dict[str, None] = {}
    for _, _, module in layer_parts(layers):
        for problem in _module_problems(module, size):
            seen.setdefault(problem, None)
    return list(seen)


# -- the rules -----------------------------------------------------------------------------


def _shard_attention(attn: Attention | GatedAttention, group: mx.distributed.Group) -> None:
    size, rank = group.size(), group.rank()
    split = _attention_heads(attn, size, rank)
    hd = attn.head_dim
    # GatedAttention's q_proj gives each head's query and output gate side by side
    q_rows = hd * (2 if isinstance(attn, GatedAttention) else 1)
    take_rows(attn.q_proj, head_rows(split.slots, q_rows))
    for proj in (attn.k_proj, attn.v_proj):
        take_rows(proj, head_rows(split.groups, hd))
    attn.o_proj = row_parallel(attn.o_proj, group, _attention_columns(attn, size, rank))
    attn.n_heads, attn.n_kv_heads = split.head_count, split.group_count


def _shard_mla(attn: MultiLatentAttention, group: mx.distributed.Group) -> None:
    size, rank = group.size(), group.rank()
    cfg = attn.cfg
    start, stop = _mla_heads(attn, size, rank)
    query = attn.q_proj if cfg.q_lora_rank is None else attn.q_b_proj
    take_rows(query, span(start * cfg.qk_head_dim, stop * cfg.qk_head_dim))
    per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
    take_rows(attn.kv_b_proj, span(start * per_head, stop * per_head))
    attn.o_proj = row_parallel(attn.o_proj, group, _mla_columns(attn, size, rank))
    attn.cfg = replace(cfg, num_heads=stop - start)


def _shard_delta_net(net: GatedDeltaNet, group: mx.distributed.Group) -> None:
    size, rank = group.size(), group.rank()
    d = net.dims
    split = _delta_heads(net, size, rank)
    keys = head_rows(split.groups, d.head_k_dim)
    values = head_rows(split.slots, d.head_v_dim)
    # the conv's channels (and in_proj_qkv's rows) are [queries | keys | values]; the
    # key heads' query and key rows alike, repeated where the split repeats key heads
    # (no padding here, so the offsets below never meet a PAD)
    channels = np.concatenate([keys, d.key_dim + keys, 2 * d.key_dim + values])
    take_rows(net.in_proj_qkv, channels)
    take_rows(net.conv1d, channels)
    take_rows(net.in_proj_z, values)
    heads = head_rows(split.slots, 1)
    take_rows(net.in_proj_b, heads)
    take_rows(net.in_proj_a, heads)
    net.dt_bias = slice_rows(net.dt_bias, heads)
    net.A_log = slice_rows(net.A_log, heads)
    net.out_proj = row_parallel(net.out_proj, group, _delta_columns(net, size, rank))
    net.dims = replace(d, num_k_heads=split.group_count, num_v_heads=split.head_count)


def _shard_columns(mlp: MLP, group: mx.distributed.Group) -> Index:
    """gate/up keep this rank's columns; returns the down_proj inputs that go with them."""
    rows = span(*_mlp_rows(mlp, group.size(), group.rank()))
    take_rows(mlp.gate_proj, rows)
    take_rows(mlp.up_proj, rows)
    return rows


def _shard_mlp(mlp: MLP, group: mx.distributed.Group) -> None:
    mlp.down_proj = row_parallel(mlp.down_proj, group, _shard_columns(mlp, group))


class ExpertParallelMoE(SparseMoE):
    """A SparseMoE holding experts [start, stop) of every rank's router choices: the
    rank's part of the layer's output, with the ranks' parts (and the split shared
    experts') added by one all_sum."""

    def __init__(self, moe: SparseMoE, group: mx.distributed.Group, start: int, stop: int):
        # the parts of the whole layer, not fresh ones: SparseMoE.__init__ is not run
        Module.__init__(self)
        self.routing = moe.routing
        self.gate = moe.gate
        self.switch_mlp = moe.switch_mlp
        self.shared_experts = moe.shared_experts
        self.shared_expert = moe.shared_expert
        self.shared_expert_gate = moe.shared_expert_gate
        self.group = group
        self.start, self.stop = start, stop

    def __call__(self, x: mx.array) -> mx.array:
        weights, indices = self.route(x)
        held = (indices >= self.start) & (indices < self.stop)
        # experts held elsewhere go to this rank's first one, and their outputs to zero
        local = mx.where(held, indices - self.start, 0).astype(mx.uint32)
        experts = self.switch_mlp(x, local) * mx.expand_dims(weights, -1)
        out = mx.where(mx.expand_dims(held, -1), experts, 0.0).sum(axis=-2).astype(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return mx.distributed.all_sum(out, group=self.group)


def _shard_moe(moe: SparseMoE, group: mx.distributed.Group) -> ExpertParallelMoE:
    size, rank = group.size(), group.rank()
    experts = int(moe.switch_mlp.gate_proj["weight"].shape[0])
    start, stop = rank * experts // size, (rank + 1) * experts // size
    for proj in (moe.switch_mlp.gate_proj, moe.switch_mlp.up_proj, moe.switch_mlp.down_proj):
        take_rows(proj, span(start, stop))
    for shared in (moe.shared_experts, moe.shared_expert):
        if shared is not None:
            # partial sums: they join the experts' all_sum instead of one of their own
            take_columns(shared.down_proj, _shard_columns(shared, group))
    return ExpertParallelMoE(moe, group, start, stop)


_Rule = Callable[[Any, mx.distributed.Group], Module | None]


def _rule(module: Module) -> _Rule:
    if isinstance(module, ExpertParallelMoE):
        raise ValueError("the model is already tensor-parallel")
    if isinstance(module, (Attention, GatedAttention)):
        return _shard_attention
    if isinstance(module, MultiLatentAttention):
        return _shard_mla
    if isinstance(module, GatedDeltaNet):
        return _shard_delta_net
    if isinstance(module, SparseMoE):
        return _shard_moe
    if isinstance(module, MLP):
        return _shard_mlp
    raise ValueError(f"no tensor-parallel rule for {type(module).__name__}")


def shard_tensor(layers: list[Any], group: mx.distributed.Group) -> None:
    """Split every layer's mixer and MLP in place (nothing changes if any cannot split)."""
    problems = tensor_problems(layers, group.size())
    if problems:
        raise ValueError("cannot split this model for tensor parallel: " + "; ".join(problems))
    for layer, name, module in list(layer_parts(layers)):
        replacement = _rule(module)(module, group)
        if replacement is not None:
            setattr(layer, name, replacement)


def all_sums_per_token(layers: list[Any]) -> int:
    """The all_sums a tensor-parallel forward runs per token: one after each mixer's
    and each MLP's (or MoE's) row-parallel projection."""
    return sum(1 for _ in layer_parts(layers))


__all__ = [
    "LAYER_PARTS",
    "ExpertParallelMoE",
    "all_sums_per_token",
    "layer_parts",
    "shard_tensor",
    "tensor_problems",
]
