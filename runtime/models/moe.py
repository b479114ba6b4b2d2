"""Mixture-of-experts pieces: expert stacks on gather matmuls, routers, the sparse block.

Experts are stored stacked, one (num_experts, out, in) array per projection, under
``<block>.switch_mlp.{gate,up,down}_proj`` (the layout mlx-community publishes), and run
with ``mx.gather_mm`` (``mx.gather_qmm`` once quantized): every token multiplies only its
top-k experts' matrices, with no Python loop over experts.

Routers are plain functions from router logits to (weights, expert ids):

- `softmax_topk`: softmax over all experts, top k, optional renormalisation
  (qwen2_moe / qwen3_moe / qwen3_next / qwen3_5 `norm_topk_prob`); optionally
  group-limited and scaled (deepseek_v2).
- `grouped_sigmoid_topk`: sigmoid scores, `e_score_correction_bias` for the choice only,
  group-limited top k (`n_group`, `topk_group`), renormalisation and
  `routed_scaling_factor` (glm4_moe, deepseek_v3).

Group-limited choice (`limit_groups`) scores a group by the sum of its two best experts
(GROUP_TOP2: DeepSeek-V3, GLM, and llama.cpp for every architecture) or by its best one
(GROUP_MAX: DeepSeek-V2's ``group_limited_greedy``).

`SparseMoE` puts a router, the experts and an optional shared expert together;
`stack_experts` turns HF checkpoint layouts into the stacked one (for `sanitize`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

from runtime.models.base import MLP, activation
from runtime.models.linear import Linear

# From this many (token, expert) pairs on, rows are sorted by expert before the gather
# matmuls: each expert's matrix is then read once per run of rows instead of once per
# row (MLX's sorted kernels on Metal/CUDA; fewer weight reloads on the CPU).
SORT_THRESHOLD = 64

SOFTMAX = "softmax"
SIGMOID = "sigmoid"
GROUP_TOP2 = "top2"
GROUP_MAX = "max"


# -- routers ------------------------------------------------------------------------------


def limit_groups(
    choice: mx.array, n_group: int, topk_group: int, group_score: str = GROUP_TOP2
) -> mx.array:
    """(..., E) choice scores with the experts outside the `topk_group` best of `n_group`
    equal groups set to -inf (unchanged when every group stays eligible)."""
    if n_group <= 1 or topk_group >= n_group:
        return choice
    num_experts = choice.shape[-1]
    grouped = choice.reshape(*choice.shape[:-1], n_group, num_experts // n_group)
    if group_score == GROUP_MAX:
        group_scores = grouped.max(axis=-1)
    else:
        group_scores = mx.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
    # the (n_group - topk_group) weakest groups drop out
    dropped = mx.argpartition(group_scores, kth=n_group - topk_group - 1, axis=-1)
    dropped = dropped[..., : n_group - topk_group]
    keep = mx.ones(group_scores.shape, dtype=mx.bool_)
    keep = mx.put_along_axis(keep, dropped, mx.array(False), axis=-1)
    grouped = mx.where(mx.expand_dims(keep, -1), grouped, mx.array(-mx.inf, mx.float32))
    return grouped.reshape(choice.shape)


def softmax_topk(
    logits: mx.array,
    top_k: int,
    *,
    normalize: bool,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = GROUP_TOP2,
    scaling: float = 1.0,
) -> tuple[mx.array, mx.array]:
    """Softmax router: (..., E) logits -> (..., k) float32 weights and uint32 expert ids.

    Weights are the softmax probabilities of the k chosen experts over all E, divided by
    their sum when `normalize` (qwen's ``norm_topk_prob``), then multiplied by `scaling`.
    With `n_group` > 1 only the experts of the `topk_group` best groups (`limit_groups`)
    can be chosen. The k ids come unordered.
    """
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    choice = limit_groups(probs, n_group, topk_group, group_score)
    indices = mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(probs, indices, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, indices.astype(mx.uint32)


def grouped_sigmoid_topk(
    logits: mx.array,
    top_k: int,
    *,
    correction_bias: mx.array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = GROUP_TOP2,
    normalize: bool = True,
    scaling: float = 1.0,
) -> tuple[mx.array, mx.array]:
    """DeepSeek-V3 / GLM-4.5 router: (..., E) logits -> (..., k) float32 weights, uint32 ids.

    1. scores = sigmoid(logits); the choice uses scores + `correction_bias`
       (``e_score_correction_bias``, a load-balancing offset that never enters the weights).
    2. With `n_group` > 1 the E experts form `n_group` equal groups; a group's score is
       the sum of its two best choice scores, and only the `topk_group` best groups stay
       eligible (the rest are masked to -inf, as transformers does).
    3. The k best eligible experts by choice score are chosen; their weights are the
       plain sigmoid scores, divided by their sum (+1e-20) when `normalize`
       (``norm_topk_prob``), then multiplied by `scaling` (``routed_scaling_factor``).
    """
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores if correction_bias is None else scores + correction_bias.astype(mx.float32)
    choice = limit_groups(choice, n_group, topk_group, group_score)
    indices = mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(scores, indices, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, indices.astype(mx.uint32)


@dataclass(frozen=True)
class Routing:
    """A router's configuration: `scoring` is SOFTMAX (`softmax_topk`) or SIGMOID
    (`grouped_sigmoid_topk`); `group_score` is GROUP_TOP2 or GROUP_MAX (`limit_groups`)."""

    top_k: int
    scoring: str = SOFTMAX
    normalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    group_score: str = GROUP_TOP2

    def __post_init__(self) -> None:
        if self.scoring not in (SOFTMAX, SIGMOID):
            raise ValueError(f"unknown router scoring {self.scoring!r}")
        if self.group_score not in (GROUP_TOP2, GROUP_MAX):
            raise ValueError(f"unknown group score {self.group_score!r}")


class SigmoidGate(Module):
    """The router of sigmoid-scored models: ``weight`` (E, dims) and the float32
    ``e_score_correction_bias`` (E,). Returns float32 logits, as transformers computes
    them (the choice between near-equal experts is sensitive to rounding)."""

    def __init__(self, dims: int, num_experts: int) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, dims))
        self.e_score_correction_bias = mx.zeros((num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32) @ self.weight.astype(mx.float32).T


# -- experts ------------------------------------------------------------------------------


class SwitchLinear(Module):
    """`num_experts` linear maps in one (E, out, in) ``weight``; row i of the input goes
    through expert ``indices[i]`` (mx.gather_mm)."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_dims)
        self.weight = mx.random.uniform(-bound, bound, (num_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x (..., M, in) and indices broadcastable to its batch dims -> (..., M, out)."""
        out = mx.gather_mm(
            x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
        )
        if "bias" in self:
            out = out + mx.expand_dims(self.bias[indices], -2)
        return out

    def to_quantized(
        self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_: Any
    ) -> QuantizedSwitchLinear:
        """The same experts, MLX-quantized (what `nn.quantize` and the loader call)."""
        quantized = QuantizedSwitchLinear(self.weight, group_size=group_size, bits=bits, mode=mode)
        if "bias" in self:
            quantized.bias = self.bias
        return quantized


class QuantizedSwitchLinear(Module):
    """`SwitchLinear` with MLX-quantized expert matrices: ``weight`` (packed), ``scales``
    and, in affine mode, ``biases``, each stacked over experts (mx.gather_qmm)."""

    def __init__(
        self, weight: mx.array, *, group_size: int = 64, bits: int = 4, mode: str = "affine"
    ) -> None:
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        # lazy: a checkpoint's packed weights replace these before anything evaluates them
        packed, scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        self.weight, self.scales = packed, scales
        if biases:
            self.biases = biases[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        out = mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        if "bias" in self:
            out = out + mx.expand_dims(self.bias[indices], -2)
        return out


class SwitchGLU(Module):
    """The experts of a gated MLP: down(act(gate(x)) * up(x)) with each token's own k."""

    def __init__(self, dims: int, hidden: int, num_experts: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, num_experts)
        self.up_proj = SwitchLinear(dims, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dims, num_experts)
        self._act = activation(act)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (..., dims), indices (..., k) -> (..., k, dims): each chosen expert's output."""
        if indices.size >= SORT_THRESHOLD:
            return self._sorted(x, indices)
        rows = mx.expand_dims(x, (-2, -3))  # (..., 1, 1, dims): one row per token
        return self._experts(rows, indices, sorted_indices=False).squeeze(-2)

    def _experts(self, rows: mx.array, indices: mx.array, *, sorted_indices: bool) -> mx.array:
        gate = self.gate_proj(rows, indices, sorted_indices)
        up = self.up_proj(rows, indices, sorted_indices)
        return self.down_proj(self._act(gate) * up, indices, sorted_indices)

    def _sorted(self, x: mx.array, indices: mx.array) -> mx.array:
        """The same result with the (token, expert) pairs grouped by expert."""
        top_k, dims = indices.shape[-1], x.shape[-1]
        flat = indices.flatten()
        order = mx.argsort(flat)
        rows = x.reshape(-1, 1, dims)[order // top_k]  # (N*k, 1, dims), grouped by expert
        out = self._experts(rows, flat[order], sorted_indices=True)
        return out[mx.argsort(order)].reshape(*indices.shape, dims)


# -- the block ----------------------------------------------------------------------------


class SparseMoE(Module):
    """Router + experts (+ shared expert), named as mlx-community checkpoints name them.

    ``gate``: a bias-free Linear (softmax routing) or a `SigmoidGate` (sigmoid routing);
    ``switch_mlp``: the `SwitchGLU` experts. `shared_hidden` adds an always-on gated MLP:
    ``shared_experts`` added as is (glm4_moe, deepseek_v3, deepseek_v2), or with
    `gated_shared` ``shared_expert`` scaled by sigmoid(``shared_expert_gate``(x))
    (qwen3_next, qwen3_5).
    """

    def __init__(
        self,
        dims: int,
        hidden: int,
        num_experts: int,
        routing: Routing,
        *,
        act: str = "silu",
        shared_hidden: int | None = None,
        gated_shared: bool = False,
    ) -> None:
        super().__init__()
        self.routing = routing
        self.gate: Linear | SigmoidGate
        if routing.scoring == SIGMOID:
            self.gate = SigmoidGate(dims, num_experts)
        else:
            self.gate = Linear(dims, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(dims, hidden, num_experts, act)
        self.shared_experts: MLP | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_hidden and gated_shared:
            self.shared_expert = MLP(dims, shared_hidden, act)
            self.shared_expert_gate = Linear(dims, 1, bias=False)
        elif shared_hidden:
            self.shared_experts = MLP(dims, shared_hidden, act)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(..., dims) -> (..., k) float32 weights and uint32 expert ids."""
        r = self.routing
        logits = self.gate(x)
        if isinstance(self.gate, SigmoidGate):
            return grouped_sigmoid_topk(
                logits,
                r.top_k,
                correction_bias=self.gate.e_score_correction_bias,
                n_group=r.n_group,
                topk_group=r.topk_group,
                group_score=r.group_score,
                normalize=r.normalize,
                scaling=r.scaling,
            )
        return softmax_topk(
            logits,
            r.top_k,
            normalize=r.normalize,
            n_group=r.n_group,
            topk_group=r.topk_group,
            group_score=r.group_score,
            scaling=r.scaling,
        )

    def __call__(self, x: mx.array) -> mx.array:
        weights, indices = self.route(x)
        experts = self.switch_mlp(x, indices)
        out = (experts * mx.expand_dims(weights, -1)).sum(axis=-2).astype(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# -- checkpoint layouts -------------------------------------------------------------------

_PER_EXPERT = re.compile(
    r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
    r"\.(?P<kind>weight|scales|biases|bias)$"
)
_FUSED = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def stack_experts(weights: Mapping[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """HF expert layouts -> the stacked one `SwitchGLU` loads; other names pass through.

    - per expert (HF checkpoints, transformers' save_pretrained):
      ``<block>.experts.<e>.<proj>.<kind>`` for e in 0..E-1 (kind: weight, or scales and
      biases of a quantized checkpoint) -> ``<block>.switch_mlp.<proj>.<kind>``, (E, ...);
    - fused (transformers' in-memory layout, qwen3_5 checkpoints):
      ``<block>.experts.gate_up_proj`` (E, 2*hidden, dims), gate rows first, and
      ``<block>.experts.down_proj`` (E, dims, hidden);
    - already stacked (mlx-community): unchanged.

    A block missing some of its experts is an error naming them.
    """
    out: dict[str, mx.array] = {}
    groups: dict[str, dict[int, mx.array]] = defaultdict(dict)
    for name, value in weights.items():
        per_expert = _PER_EXPERT.match(name)
        fused = _FUSED.match(name) if per_expert is None else None
        if per_expert is not None:
            block, proj, kind = per_expert.group("block", "proj", "kind")
            groups[f"{block}.switch_mlp.{proj}.{kind}"][int(per_expert["expert"])] = value
        elif fused is not None and fused["proj"] == "gate_up_proj":
            gate, up = mx.split(value, 2, axis=1)
            out[f"{fused['block']}.switch_mlp.gate_proj.weight"] = gate
            out[f"{fused['block']}.switch_mlp.up_proj.weight"] = up
        elif fused is not None:
            out[f"{fused['block']}.switch_mlp.down_proj.weight"] = value
        else:
            out[name] = value
    for target, experts in groups.items():
        missing = sorted(set(range(num_experts)) - set(experts))
        extra = sorted(set(experts) - set(range(num_experts)))
        if missing or extra:
            raise ValueError(
                f"{target}: checkpoint has experts {sorted(experts)[:8]}..., expected 0.."
                f"{num_experts - 1} (missing {missing[:8]}, unexpected {extra[:8]})"
            )
        out[target] = mx.stack([experts[e] for e in range(num_experts)])
    return out


__all__ = [
    "GROUP_MAX",
    "GROUP_TOP2",
    "SIGMOID",
    "SOFTMAX",
    "SORT_THRESHOLD",
    "QuantizedSwitchLinear",
    "Routing",
    "SigmoidGate",
    "SparseMoE",
    "SwitchGLU",
    "SwitchLinear",
    "grouped_sigmoid_topk",
    "limit_groups",
    "softmax_topk",
    "stack_experts",
]
