"""The pieces tensor parallelism is made of: which heads and rows a rank holds, keeping a
slice of a layer's rows, and the row-parallel linear that sums partial outputs across ranks.

Nothing needs to divide evenly. Heads are dealt out contiguously, as evenly as possible
(9 over 4 ranks: 3, 2, 2, 2); a rank keeps the key/value heads (a delta-net's key heads)
its heads read, so one whose group straddles two ranks is held by both. MLP and expert
widths split as evenly as whole quantization groups allow. The all_sum after each
row-parallel projection adds the ranks' partial outputs whatever their shares.

Column-parallel projections (q/k/v, gate/up, expert stacks, conv channels) need no
communication: each rank keeps its rows of the weight in the layer it already is (plain,
CPU-kernel or quantized), so `take_rows` slices in place. Row-parallel projections
(o_proj, down_proj, out_proj) become `RowParallelLinear` (or its quantized twin): each
rank multiplies its columns and an all_sum adds the partial outputs.

Rows and columns are given as an index array (`Index`); -1 stands for a row of zeros,
the padding an uneven attention split may need (see `split_heads`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.quantized import QuantizedLinear

from runtime import kernels as cpu_kernels

Index = np.ndarray[Any, np.dtype[np.int64]]
PAD = -1  # an index that stands for zeros


# -- who holds what ------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSplit:
    """The heads one rank holds, as the model's layer will see them after the split.

    `slots[i]` is the global head (query head, or a delta-net's value head) in local head
    i, None for a padding head of zeros; `groups[j]` is the global group (key/value head,
    a delta-net's key head) in local group j. Local head i reads local group
    i // repeat, the layout grouped-query attention and the delta-net's `repeat` assume.

    A rank's heads are contiguous, but the groups they read need not hold equally many of
    them (9 heads over 3 key/value heads, heads 0..4 on one rank: 3 read group 0, 2 read
    group 1). Two ways make the layout uniform: pad a group's heads up to `repeat` with
    heads of zeros (their queries are zero and o_proj's columns for them are zero, so
    they add nothing), or hold a group more than once. Attention takes the cheaper mix
    (`split_heads`); the delta-net, whose every head carries a recurrent state, only
    repeats key heads.
    """

    heads: tuple[int, int]
    slots: tuple[int | None, ...]
    groups: tuple[int, ...]

    @property
    def head_count(self) -> int:
        return len(self.slots)

    @property
    def group_count(self) -> int:
        return len(self.groups)

    @property
    def repeat(self) -> int:
        return len(self.slots) // len(self.groups)

    @property
    def padding(self) -> int:
        return sum(1 for s in self.slots if s is None)

    @property
    def cost(self) -> int:
        """The rank's per-head work: a head slot and a group slot counted alike (each
        is one head's projection rows; a group slot is also one head's cache)."""
        return len(self.slots) + len(self.groups)


def _group_counts(start: int, stop: int, heads: int, groups: int) -> list[tuple[int, int, int]]:
    """(group, first head, head count) of every group heads [start, stop) read."""
    per = heads // groups
    out = []
    for g in range(start // per, (stop - 1) // per + 1):
        first, last = max(start, g * per), min(stop, (g + 1) * per)
        out.append((g, first, last - first))
    return out


def _layout(start: int, stop: int, heads: int, groups: int, pad: bool) -> HeadSplit:
    counts = _group_counts(start, stop, heads, groups)
    sizes = [c for _, _, c in counts]
    if pad:
        # the repeat with the least work, ties to fewer groups (less cache)
        def work(r: int) -> tuple[int, int]:
            held = sum(math.ceil(c / r) for c in sizes)
            return (r + 1) * held, held

        repeat = min(range(1, max(sizes) + 1), key=work)
    else:
        repeat = math.gcd(*sizes)
    slots: list[int | None] = []
    held: list[int] = []
    for group, first, count in counts:
        copies = math.ceil(count / repeat)
        held += [group] * copies
        slots += [*range(first, first + count), *[None] * (copies * repeat - count)]
    return HeadSplit((start, stop), tuple(slots), tuple(held))


@lru_cache(maxsize=256)
def head_ranges(heads: int, groups: int, size: int, pad: bool) -> tuple[tuple[int, int], ...]:
    """Every rank's contiguous range of `heads`: shares of heads // size or one more, the
    larger ones placed where they cost least. With the ranks in lockstep the slowest sets
    the pace, so the largest rank's `HeadSplit.cost` is minimised first, then the sum;
    ties go to the larger shares first. 14 heads over 2 groups and 4 ranks: 4, 3, 4, 3
    (no rank's heads straddle a group) rather than 4, 4, 3, 3 (one rank pads or repeats)."""
    if not 0 < size <= heads or groups < 1 or heads % groups:
        raise ValueError(f"{heads} heads over {groups} groups cannot split over {size} ranks")
    base, extra = divmod(heads, size)

    def cost(rank: int, used: int, bigger: int) -> int:
        start = rank * base + used
        return _layout(start, start + base + bigger, heads, groups, pad).cost

    def choices(rank: int, used: int) -> list[int]:
        # a larger share first (the tie-break), if the ranks after can still take the rest
        return [b for b in (1, 0) if used + b <= extra and extra - used - b <= size - rank - 1]

    inf = math.inf
    # worst[r][u]: the least possible largest cost of ranks r.. when earlier ranks took
    # u larger shares; total[r][u]: their least sum with no rank above the best worst
    worst = [[inf] * (extra + 1) for _ in range(size + 1)]
    worst[size][extra] = 0
    for rank in range(size - 1, -1, -1):
        for used in range(extra + 1):
            for b in choices(rank, used):
                later = worst[rank + 1][used + b]
                worst[rank][used] = min(worst[rank][used], max(cost(rank, used, b), later))
    bound = worst[0][0]
    total = [[inf] * (extra + 1) for _ in range(size + 1)]
    total[size][extra] = 0
    for rank in range(size - 1, -1, -1):
        for used in range(extra + 1):
            for b in choices(rank, used):
                c = cost(rank, used, b)
                if c <= bound:
                    total[rank][used] = min(total[rank][used], c + total[rank + 1][used + b])
    ranges, used = [], 0
    for rank in range(size):
        for b in choices(rank, used):
            c = cost(rank, used, b)
            if c <= bound and c + total[rank + 1][used + b] == total[rank][used]:
                start = rank * base + used
                ranges.append((start, start + base + b))
                used += b
                break
    return tuple(ranges)


def split_heads(heads: int, groups: int, size: int, rank: int, *, pad: bool = True) -> HeadSplit:
    """Rank `rank`'s share of `heads` reading `groups` (see HeadSplit, `head_ranges`).

    `pad` (attention): the repeat with the least work, a head slot and a group slot
    counted alike, ties to fewer groups; a group's heads short of it are padded with
    heads of zeros, a group with more is held again. Usually that is each group once,
    padded (heads 0..4 of SmolLM2's 9 over 3: [0 1 2 | 3 4 pad] over groups 0 and 1).
    Without it (the delta-net) nothing is padded: the repeat is the greatest common
    divisor of the counts and groups are held as often as that asks.

    Where `size` divides `heads` and `groups` divides or is divided by `size`, every rank
    holds whole groups or one group and nothing is padded or repeated."""
    start, stop = head_ranges(heads, groups, size, pad)[rank]
    return _layout(start, stop, heads, groups, pad)


def head_problem(heads: int, groups: int, size: int, names: tuple[str, str]) -> str | None:
    """Why `heads` reading `groups` cannot be split over `size` ranks; None if they can."""
    if groups < 1 or heads % groups:
        return f"{names[0]}={heads} is not a multiple of {names[1]}={groups}"
    if size > heads:
        return (
            f"{names[0]}={heads} cannot be split over {size} ranks: tensor parallel "
            f"needs at least one head per rank (at most {heads} ranks); pipeline parallel "
            "has no such limit"
        )
    return None


def balanced_range(total: int, size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank `rank`'s contiguous share of `total` rows in whole `unit`s (quantization
    groups), as even as they allow, the larger shares first; `total // unit >= size`."""
    base, extra = divmod(total // unit, size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start * unit, stop * unit


# -- index arrays --------------------------------------------------------------------------


def span(start: int, stop: int) -> Index:
    return np.arange(start, stop, dtype=np.int64)


def head_rows(heads: Sequence[int | None], width: int, offset: int = 0) -> Index:
    """The rows of `heads` (each `width` rows, from `offset`); a None head gives PADs."""
    parts = [
        np.full(width, PAD, dtype=np.int64)
        if h is None
        else span(offset + h * width, offset + (h + 1) * width)
        for h in heads
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _gather(value: mx.array, index: Index, axis: int) -> mx.array:
    pad = index < 0
    # a gather, which always writes a new buffer: a slice (even through mx.contiguous)
    # may share the whole checkpoint tensor's buffer and keep it alive
    out = mx.take(value, mx.array(np.where(pad, 0, index).astype(np.int32)), axis=axis)
    if not pad.any():
        return out
    shape = [1] * out.ndim
    shape[axis] = len(index)
    keep = mx.array(~pad).reshape(shape)
    return mx.where(keep, out, mx.zeros((), dtype=out.dtype))


def take_rows(module: Module, rows: Index) -> None:
    """Keep only `rows` (PAD: a row of zeros) along axis 0 of every array `module` holds
    itself: weight and bias of a linear, packed weight, scales and biases of a quantized
    one (a zero row of each dequantizes to zeros), a depthwise conv's channels, an expert
    stack's experts."""
    module.update({k: _gather(v, rows, 0) for k, v in module.items() if isinstance(v, mx.array)})


def slice_rows(value: mx.array, rows: Index) -> mx.array:
    """`rows` of one array (a per-head parameter such as a decay or a bias)."""
    return _gather(value, rows, 0)


def in_features(linear: Module) -> int:
    """The input width of a plain or quantized linear layer."""
    weight: mx.array = linear["weight"]
    if isinstance(linear, QuantizedLinear):
        return int(weight.shape[-1]) * 32 // int(linear.bits)
    return int(weight.shape[-1])


def out_features(linear: Module) -> int:
    return int(linear["weight"].shape[0])


def quantization_unit(linear: Module) -> int:
    """The inputs a rank must take together: a quantized layer's group size, else 1."""
    return int(linear.group_size) if isinstance(linear, QuantizedLinear) else 1


def _column_groups(columns: Index, group_size: int) -> Index | None:
    """The quantization groups `columns` are made of (PAD for a group of zeros), or None
    if they are not whole, aligned groups."""
    if len(columns) % group_size:
        return None
    blocks = columns.reshape(-1, group_size)
    first = blocks[:, 0]
    padded = (blocks == PAD).all(axis=1)
    runs = (blocks == first[:, None] + span(0, group_size)).all(axis=1)
    aligned = runs & (first % group_size == 0)
    if not (padded | aligned).all():
        return None
    return np.where(padded, PAD, first // group_size)


def columns_problem(linear: Module, columns: Index, label: str) -> str | None:
    """Why `linear` cannot keep just `columns` of its inputs (None if it can): a quantized
    layer splits only on whole quantization groups."""
    if not isinstance(linear, QuantizedLinear):
        return None
    unit = int(linear.group_size)
    if _column_groups(columns, unit) is not None:
        return None
    return (
        f"{label}: a rank's inputs do not fall on whole quantization groups of "
        f"{unit} (heads or widths not a multiple of the group size); use fewer ranks, "
        "an unquantized or smaller-group copy, or pipeline parallel"
    )


def _take_columns(linear: Module, columns: Index) -> dict[str, mx.array]:
    """`linear`'s input columns `columns` (PAD: zeros) as its new arrays; a bias stays."""
    arrays: dict[str, mx.array] = {}
    if isinstance(linear, QuantizedLinear):
        unit, bits = int(linear.group_size), int(linear.bits)
        groups = _column_groups(columns, unit)
        if groups is None:
            raise ValueError(columns_problem(linear, columns, "a row-parallel layer"))
        words = unit * bits // 32  # packed uint32 words per group
        packed = (groups[:, None] * words + span(0, words)).reshape(-1)
        packed = np.where(np.repeat(groups, words) == PAD, PAD, packed)
        arrays["weight"] = _gather(linear["weight"], packed, 1)
        for name in ("scales", "biases"):
            if name in linear:
                arrays[name] = _gather(linear[name], groups, 1)
    else:
        arrays["weight"] = _gather(linear["weight"], columns, 1)
    if "bias" in linear:
        arrays["bias"] = linear["bias"]
    return arrays


def take_columns(linear: Module, columns: Index) -> None:
    """Keep only `columns` of `linear`'s inputs, in place (no sum: a partial output that
    joins someone else's all_sum, such as a shared expert's inside an MoE's)."""
    linear.update(_take_columns(linear, columns))


class RowParallelLinear(Module):
    """This rank's input columns of a linear layer: it multiplies them (through the CPU's
    few-rows kernel where it applies, runtime.models.linear), an all_sum adds the ranks'
    partial outputs, and the bias is added once, after the sum. The ranks' column counts
    may differ."""

    def __init__(self, arrays: dict[str, mx.array], group: mx.distributed.Group) -> None:
        super().__init__()
        self.weight = arrays["weight"]
        if "bias" in arrays:
            self.bias = arrays["bias"]
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        weight: mx.array = self["weight"]
        out = cpu_kernels.linear(x, weight)
        if out is None:
            out = x @ weight.T
        out = mx.distributed.all_sum(out, group=self.group)
        return out + self["bias"] if "bias" in self else out


class QuantizedRowParallelLinear(Module):
    """`RowParallelLinear` over MLX-quantized columns (whole quantization groups)."""

    def __init__(
        self, arrays: dict[str, mx.array], linear: QuantizedLinear, group: mx.distributed.Group
    ) -> None:
        super().__init__()
        self.group_size, self.bits = int(linear.group_size), int(linear.bits)
        self.mode = str(getattr(linear, "mode", "affine"))
        for name, value in arrays.items():
            setattr(self, name, value)
        self.group = group
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        out = cpu_kernels.qmatmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        out = mx.distributed.all_sum(out, group=self.group)
        return out + self["bias"] if "bias" in self else out


def row_parallel(linear: Module, group: mx.distributed.Group, columns: Index) -> Any:
    """A row-parallel copy of `linear` holding its input `columns` (PAD: zero columns,
    for padding heads). Typed Any: it takes the place of an attribute the model
    declares as its Linear."""
    arrays = _take_columns(linear, columns)
    if isinstance(linear, QuantizedLinear):
        return QuantizedRowParallelLinear(arrays, linear, group)
    return RowParallelLinear(arrays, group)


def is_row_parallel(module: object) -> bool:
    return isinstance(module, (RowParallelLinear, QuantizedRowParallelLinear))


__all__ = [
    "PAD",
    "HeadSplit",
    "Index",
    "QuantizedRowParallelLinear",
    "RowParallelLinear",
    "balanced_range",
    "columns_problem",
    "head_problem",
    "head_ranges",
    "head_rows",
    "in_features",
    "is_row_parallel",
    "out_features",
    "quantization_unit",
    "row_parallel",
    "slice_rows",
    "span",
    "split_heads",
    "take_columns",
    "take_rows",
]
