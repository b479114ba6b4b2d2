"""The prefix cache's invariants, checked on demand (tests and debugging): the trie is
well formed, the live path runs down from its root, the live caches hold exactly that
path (between requests), and the snapshots held in memory fit the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from runtime.cache import LayerCache
from runtime.prefix.trie import Node, Trie


def verify_live(
    trie: Trie,
    path: Sequence[Node],
    caches: Sequence[LayerCache],
    *,
    lent: bool,
    leased: bool,
    limit_bytes: int,
) -> None:
    """Raise AssertionError if an invariant is broken. `lent`: the live path's state is
    in a batch row (runtime/prefix/loan.py); `leased`: a request is running."""
    trie.verify()
    if path[0] is not trie.root:
        raise AssertionError("the live path does not start at the root")
    for upper, lower in pairwise(path):
        if lower.parent is not upper:
            raise AssertionError(f"live path broken between {upper} and {lower}")
    live = path[-1].end
    offsets = {c.offset for c in caches}
    if lent:
        offsets = {live}  # lent: the live caches are empty until taken back
    if not leased and offsets and offsets != {live}:
        raise AssertionError(f"live caches at {offsets}, live path ends at {live}")
    if any(o < live for o in offsets):
        raise AssertionError(f"live caches at {offsets} behind the live path end {live}")
    if trie.paged_bytes > limit_bytes:
        raise AssertionError(f"{trie.paged_bytes} bytes held, limit {limit_bytes}")
