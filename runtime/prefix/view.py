"""A read-only copy of the prefix trie's shape, for the admin view (gateway/admin/trie.py).

Taken on the engine's thread (the trie changes only there) and frozen, so any thread may
read it: each node's edge of keys (the tuple the node holds, not a copy), where it sits,
the snapshot bytes it keeps in memory and on disk, whether it is on the live path or
holds a pinned prompt, and whether eviction would take it next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.prefix.trie import DeferredSnapshot, Key, Node, Trie

DEFAULT_NODES = 512  # the most nodes a view copies (the shallowest first)


@dataclass(frozen=True)
class NodeView:
    index: int  # its place in the view; the root is 0
    parent: int  # the parent's index; -1 for the root
    start: int  # the offset its edge starts at
    keys: tuple[Key, ...]  # its edge: token ids, or image keys
    memory_bytes: int  # snapshot bytes held in memory
    layers: int  # layers with a snapshot (in memory or on disk)
    disk_layers: int  # of those, on disk
    live: bool  # on the live path (the caches hold its tokens)
    pinned: bool  # holds a pinned prompt's tokens
    evicted: bool  # eviction dropped state it had
    last_used: int  # the cache's tick when it was last used (larger: more recent)
    next_eviction: bool  # the node eviction would take next

    @property
    def end(self) -> int:
        return self.start + len(self.keys)


@dataclass(frozen=True)
class TrieView:
    nodes: tuple[NodeView, ...]  # parents before children
    total: int  # nodes in the trie, the root included (the view may hold fewer)


def trie_view(
    trie: Trie,
    live: Sequence[Node],
    pinned: set[int],
    victim: Node | None,
    limit: int = DEFAULT_NODES,
) -> TrieView:
    """Copy the trie breadth first (the shallowest `limit` nodes: a connected tree)."""
    on_path = {id(n) for n in live}
    out: list[NodeView] = []
    total = 0
    queue: deque[tuple[Node, int]] = deque([(trie.root, -1)])
    while queue:
        node, parent = queue.popleft()
        total += 1
        if len(out) >= limit:
            queue.extend((c, -1) for c in node.children.values())  # counted, not copied
            continue
        index = len(out)
        held = [s for s in node.snapshots if s is not None]
        out.append(
            NodeView(
                index=index,
                parent=parent,
                start=node.start,
                keys=node.keys,
                memory_bytes=node.snapshot_bytes(),
                layers=len(held),
                disk_layers=sum(isinstance(s, DeferredSnapshot) for s in held),
                live=id(node) in on_path,
                pinned=id(node) in pinned,
                evicted=node.evicted,
                last_used=node.last_used,
                next_eviction=node is victim,
            )
        )
        queue.extend((c, index) for c in node.children.values())
    return TrieView(tuple(out), total)
