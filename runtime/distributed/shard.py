"""Split a built model across the ranks of a group: tensor or pipeline parallel.

`shard_model` works on a model whose weights are loaded but not yet evaluated (the
loader's `shard` hook, runtime/distributed/load.py): slicing a lazily loaded tensor
and dropping the rest means a rank reads, and keeps, only its part. After it, on every
rank, ``model.logits(model.forward(tokens, caches))`` gives the whole model's logits
and ``model.make_caches()`` gives caches for that rank's part only.

- tensor (runtime/distributed/tensor.py): heads, MLP columns and experts split (as
  evenly as they go: no count has to divide the group size), an all_sum after each
  layer's row-parallel projections; 2 all_sums per layer per token. Every rank runs
  every layer, so it suits fast links (Thunderbolt, NVLink).
- pipeline (runtime/distributed/pipeline.py): contiguous stages of layers; one
  activation sent per stage boundary and one broadcast per forward. Little traffic,
  for models too large for one host over slow links; ranks take turns, so one
  sequence runs no faster than on one host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import mlx.core as mx

from runtime.distributed.group import GroupLike, handle_of
from runtime.distributed.pipeline import shard_pipeline
from runtime.distributed.tensor import all_sums_per_token, shard_tensor, tensor_problems
from runtime.models.base import LanguageModel

Mode = Literal["tensor", "pipeline"]
MODES: tuple[str, ...] = get_args(Mode)
_ATTRIBUTE = "distributed_shard"


@dataclass(frozen=True)
class ShardInfo:
    """What part of the model a rank holds (kept on the model by `shard_model`)."""

    mode: str
    rank: int
    size: int
    layers: range  # the global indices of the layers this rank runs
    num_layers: int
    hidden_size: int
    dtype: mx.Dtype

    def describe(self) -> str:
        if self.size == 1:
            return "the whole model (one rank)"
        if self.mode == "pipeline":
            return (
                f"pipeline stage {self.rank + 1} of {self.size}: layers "
                f"{self.layers.start}..{self.layers.stop - 1} of {self.num_layers}"
            )
        return f"tensor shard {self.rank + 1} of {self.size} of all {self.num_layers} layers"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown parallel mode {mode!r}; use one of {', '.join(MODES)}")


def shard_info(model: Any) -> ShardInfo | None:
    """The part of the model this rank holds; None if `shard_model` never ran on it."""
    info = getattr(model, _ATTRIBUTE, None)
    return info if isinstance(info, ShardInfo) else None


def _body(model: Any) -> Any:
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "norm"):
        raise ValueError(f"{type(model).__name__} has no layer stack to split")
    return body


def split_problems(model: LanguageModel, size: int, mode: str) -> list[str]:
    """Why `model` cannot be split over `size` ranks in `mode` (empty if it can)."""
    _check_mode(mode)
    layers = list(_body(model).layers)
    if mode == "pipeline":
        if len(layers) < size:
            return [f"{len(layers)} layers cannot form {size} pipeline stages"]
        return []
    return tensor_problems(layers, size)


def shard_model(model: LanguageModel, group: GroupLike, mode: Mode) -> None:
    """Reshape `model` in place so this rank holds only its part (module docstring).

    Raises ValueError, leaving the model whole, when it cannot be split (more ranks
    than heads, experts or MLP columns for tensor parallel, than layers for pipeline
    parallel; quantized inputs that would not split on whole quantization groups): the
    message names each count.
    """
    _check_mode(mode)
    if shard_info(model) is not None:
        raise ValueError("the model is already split")
    handle = handle_of(group)
    size, rank = int(handle.size()), int(handle.rank())
    body = _body(model)
    num_layers = len(body.layers)
    hidden, dtype = int(body.norm.weight.shape[0]), body.norm.weight.dtype
    stage = range(num_layers)
    if size > 1:
        problems = split_problems(model, size, mode)
        if problems:
            raise ValueError(
                f"cannot split this model over {size} ranks for {mode} parallel: "
                + "; ".join(problems)
            )
        if mode == "tensor":
            shard_tensor(list(body.layers), handle)
        else:
            stage = shard_pipeline(model, handle)
    info = ShardInfo(mode, rank, size, stage, num_layers, hidden, dtype)
    setattr(model, _ATTRIBUTE, info)


def _all_sum_bytes(nbytes: int, size: int) -> int:
    """What each rank sends in a ring all-reduce of `nbytes`: a reduce-scatter and an
    all-gather, size - 1 steps each, of one 1/size segment per step (MLX's ring)."""
    return 2 * (size - 1) * math.ceil(nbytes / size)


def comm_bytes_per_token(model: LanguageModel, group: GroupLike, mode: Mode) -> int:
    """Bytes this rank sends per token of a forward (prefill or decode alike).

    tensor: one all_sum of a hidden state after every mixer and every MLP, the same
    whatever each rank's share of heads and columns (the sum is over the whole hidden
    state, so an uneven split changes the work per rank, not the traffic);
    pipeline: the hidden state sent to the next stage (all ranks but the last) plus
    the final broadcast. Counted from the model's structure and MLX's ring algorithm,
    not measured; works on the whole model (what splitting it would cost) or on this
    rank's part.
    """
    _check_mode(mode)
    handle = handle_of(group)
    size, rank = int(handle.size()), int(handle.rank())
    info = shard_info(model)
    if info is not None and info.size > 1 and info.mode != mode:
        raise ValueError(f"the model is split for {info.mode} parallel, not {mode}")
    if size == 1:
        return 0
    body = _body(model)
    if info is None:
        hidden, dtype = int(body.norm.weight.shape[0]), body.norm.weight.dtype
    else:
        hidden, dtype = info.hidden_size, info.dtype
    state = hidden * dtype.size
    if mode == "tensor":
        return all_sums_per_token(list(body.layers)) * _all_sum_bytes(state, size)
    handoff = state if rank < size - 1 else 0
    return handoff + _all_sum_bytes(state, size)


__all__ = [
    "MODES",
    "Mode",
    "ShardInfo",
    "comm_bytes_per_token",
    "shard_info",
    "shard_model",
    "split_problems",
]
