"""Planning a restore: how each layer of the live caches reaches an offset on a trie path.

A layer reaches `target` by rewinding its live state (when it holds the tokens and can
rewind that far), or from a snapshot on the path whose [floor, end] covers `target`; a
delta snapshot (base > 0) first needs its base reached the same way. The plan for the
whole model is the deepest offset every layer reaches. Pure functions of the caches'
numbers and the snapshots' numbers: nothing is restored until `apply_plans`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.cache import LayerCache, Snapshot
from runtime.prefix.trie import DeferredSnapshot, Node


@dataclass(frozen=True)
class Step:
    """Restore one layer to `target` from the snapshot of path[node], or rewind it live."""

    node: int | None
    target: int


Plan = tuple[Step, ...]


def plan_restore(
    caches: Sequence[LayerCache], path: list[Node], matched: int, live: int, use_disk: bool
) -> tuple[int, list[Plan]]:
    """The deepest offset <= matched that every layer can reach, and each layer's steps.

    Reachable sets are unions of intervals ending at `live`, at snapshot ends or at
    `matched`, so only those offsets (and 0, always reachable) need trying. Layers with
    the same rewind floor and snapshots along the path share one plan. Without
    `use_disk`, snapshots on disk are not used.
    """
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, cache in enumerate(caches):
        sig = (cache.rewind_floor, *(_shape(_usable(n, i, use_disk)) for n in path))
        groups.setdefault(sig, []).append(i)
    candidates = sorted({0, matched, live, *(n.end for n in path if n.end < matched)})
    memos: dict[int, dict[int, Plan | None]] = {layers[0]: {} for layers in groups.values()}
    for target in reversed(candidates):
        plans: list[Plan] = [()] * len(caches)
        for layers in groups.values():
            first = layers[0]
            plan = _layer_plan(caches[first], first, path, live, target, memos[first], use_disk)
            if plan is None:
                break
            for i in layers:
                plans[i] = plan
        else:
            return target, plans
    raise AssertionError("offset 0 is always reachable")


def _layer_plan(
    cache: LayerCache,
    i: int,
    path: list[Node],
    live: int,
    target: int,
    memo: dict[int, Plan | None],
    use_disk: bool,
) -> Plan | None:
    if target in memo:
        return memo[target]
    plan: Plan | None = None
    if target == 0 or cache.rewind_floor <= target <= live:
        plan = (Step(None, target),)
    else:
        for j in range(len(path) - 1, 0, -1):
            snap = _usable(path[j], i, use_disk)
            if snap is None or not snap.floor <= target <= snap.end:
                continue
            if snap.base == 0:
                plan = (Step(j, target),)
                break
            before = None
            if snap.base < target:
                before = _layer_plan(cache, i, path, live, snap.base, memo, use_disk)
            if before is not None:
                plan = (*before, Step(j, target))
                break
    memo[target] = plan
    return plan


def deferred_steps(path: list[Node], plans: Sequence[Plan]) -> list[tuple[Node, int]]:
    """The (node, layer) pairs whose snapshot the plans use and that are on disk."""
    return [
        (path[step.node], i)
        for i, plan in enumerate(plans)
        for step in plan
        if step.node is not None and isinstance(path[step.node].snapshot(i), DeferredSnapshot)
    ]


def apply_plans(
    caches: Sequence[LayerCache], path: list[Node], plans: Sequence[Plan], target: int
) -> bool:
    """Restore every layer by its plan; False when a step fails (the caller starts clean)."""
    for i, cache in enumerate(caches):
        for step in plans[i]:
            snap = None if step.node is None else path[step.node].snapshot(i)
            if step.node is not None and snap is None:
                return False
            if not cache.restore(snap, step.target):
                return False
        if cache.offset != target:
            return False
    return True


def _usable(node: Node, layer: int, use_disk: bool) -> Snapshot | None:
    snap = node.snapshot(layer)
    return None if not use_disk and isinstance(snap, DeferredSnapshot) else snap


def _shape(snap: Snapshot | None) -> tuple[int, int, int] | None:
    return None if snap is None else (snap.base, snap.floor, snap.end)
