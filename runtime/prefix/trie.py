"""The compressed prefix trie behind the prefix cache: structure and snapshot bookkeeping.

Each node holds an edge of keys (token ids, or image keys) ending at offset `end`, and
optionally one snapshot per layer that restores that layer to `end`. Siblings never share a
first key (children are a dict keyed by it). Splitting and merging nodes splits and merges
their snapshots through the layers' caches, which know their snapshot formats. The trie
counts the bytes of every snapshot it holds; the policy (what is live, what to evict) lives
in runtime/prefix/cache.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from runtime.cache import LayerCache, Snapshot


@dataclass(frozen=True)
class ImageKey:
    """One position of an image's placeholder span, keyed by the image's content hash.

    Never equal to a token id (it is not an int), so text and images cannot alias.
    """

    digest: str
    index: int


Key: TypeAlias = int | ImageKey


@runtime_checkable
class DeferredSnapshot(Snapshot, Protocol):
    """A snapshot whose arrays are not in memory (the disk tier's, runtime/prefix/disk/tier.py):
    it holds no bytes, splits itself by its numbers, and must be read back before a
    restore uses it. Merging one is never attempted: its node is kept instead."""

    def split_at(self, at: int) -> tuple[Snapshot | None, Snapshot | None]:
        """Like `LayerCache.split`: (a part restoring to `at` or None, itself)."""
        ...


def image_keys(digest: str, count: int) -> list[ImageKey]:
    """The keys for an image that occupies `count` positions."""
    return [ImageKey(digest, i) for i in range(count)]


class Node:
    __slots__ = ("children", "end", "evicted", "keys", "last_used", "parent", "snapshots")

    def __init__(
        self, keys: tuple[Key, ...], end: int, parent: Node | None, last_used: int
    ) -> None:
        self.keys = keys
        self.end = end
        self.parent = parent
        self.children: dict[Key, Node] = {}
        self.snapshots: list[Snapshot | None] = []  # per layer, or empty: none at all
        self.last_used = last_used
        # eviction dropped state this node had (cleared when it gets snapshots again):
        # tells "evicted" from "never snapshotted" when a request cannot restore here
        self.evicted = False

    @property
    def start(self) -> int:
        return self.end - len(self.keys)

    def snapshot(self, layer: int) -> Snapshot | None:
        return self.snapshots[layer] if self.snapshots else None

    def has_snapshots(self) -> bool:
        return any(s is not None for s in self.snapshots)

    def snapshot_bytes(self) -> int:
        """Bytes held in memory (a deferred snapshot holds none)."""
        return sum(s.nbytes for s in self.snapshots if s is not None)

    def has_deferred(self) -> bool:
        return any(isinstance(s, DeferredSnapshot) for s in self.snapshots)

    def prefix_keys(self, extra: int = 0) -> tuple[Key, ...]:
        """The keys from the root to this node's start, plus its first `extra` keys."""
        parts = [self.keys[:extra]]
        node = self.parent
        while node is not None:
            parts.append(node.keys)
            node = node.parent
        return tuple(k for part in reversed(parts) for k in part)

    def __repr__(self) -> str:
        return f"Node[{self.start},{self.end})"


def _common_length(edge: tuple[Key, ...], keys: Sequence[Key], pos: int) -> int:
    """How many leading keys of `edge` equal keys[pos:]."""
    n = min(len(edge), len(keys) - pos)
    if tuple(keys[pos : pos + n]) == edge[:n]:
        return n  # the common case, compared in C
    i = 0
    while i < n and edge[i] == keys[pos + i]:
        i += 1
    return i


class Trie:
    def __init__(self, layers: Sequence[LayerCache]) -> None:
        self.layers = layers
        self.root = Node((), 0, None, 0)
        self.paged_bytes = 0

    def walk(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match(self, keys: Sequence[Key]) -> tuple[list[Node], int]:
        """The nodes along `keys` from the root (the last one may match only partly) and
        how many keys matched."""
        path, node, pos = [self.root], self.root, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            n = _common_length(child.keys, keys, pos)
            path.append(child)
            pos += n
            if n < len(child.keys):
                break
            node = child
        return path, pos

    # -- snapshots and byte accounting --

    def take_snapshots(self, node: Node) -> list[Snapshot | None]:
        """Detach the node's snapshots without closing them (the caller consumes them)."""
        old = node.snapshots
        self.paged_bytes -= node.snapshot_bytes()
        node.snapshots = []
        return old

    def set_snapshots(self, node: Node, snaps: Sequence[Snapshot | None]) -> None:
        """Replace the node's snapshots, closing the old ones."""
        for old in self.take_snapshots(node):
            if old is not None:
                old.close()
        node.snapshots = list(snaps) if any(s is not None for s in snaps) else []
        node.evicted = node.evicted and not node.snapshots
        self.paged_bytes += node.snapshot_bytes()

    def replace_snapshot(self, node: Node, layer: int, snap: Snapshot | None) -> Snapshot | None:
        """Put `snap` in one layer's place; return the one it replaces, not closed (the
        caller owns it)."""
        old = node.snapshot(layer)
        if old is None and snap is None:
            return None
        if not node.snapshots:
            node.snapshots = [None] * len(self.layers)
        self.paged_bytes += (0 if snap is None else snap.nbytes) - (
            0 if old is None else old.nbytes
        )
        node.snapshots[layer] = snap
        if not node.has_snapshots():
            node.snapshots = []
        elif snap is not None:
            node.evicted = False
        return old

    def set_snapshot(self, node: Node, layer: int, snap: Snapshot) -> None:
        """Give one layer of the node a snapshot (it must have none)."""
        if not node.snapshots:
            node.snapshots = [None] * len(self.layers)
        if node.snapshots[layer] is not None:
            raise ValueError(f"{node} already has a snapshot for layer {layer}")
        node.snapshots[layer] = snap
        node.evicted = False
        self.paged_bytes += snap.nbytes

    # -- structure --

    def insert(self, keys: Sequence[Key], last_used: int) -> Node:
        """The node ending exactly after `keys`: splits an edge or adds a child where
        needed (never grows a leaf, which may be live)."""
        node, pos = self.root, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                return self.add_child(node, tuple(keys[pos:]), last_used)
            n = _common_length(child.keys, keys, pos)
            if n < len(child.keys):
                child = self.split(child, child.start + n)
            node, pos = child, pos + n
        return node

    def add_child(self, parent: Node, keys: tuple[Key, ...], last_used: int) -> Node:
        if not keys or keys[0] in parent.children:
            raise ValueError("a new child must start with a key no sibling starts with")
        child = Node(keys, parent.end + len(keys), parent, last_used)
        parent.children[keys[0]] = child
        return child

    def split(self, node: Node, at: int) -> Node:
        """Cut `node` at offset `at` (inside its edge); return the new upper node."""
        parent = node.parent
        if parent is None or not node.start < at < node.end:
            raise ValueError(f"cannot split {node} at {at}")
        cut = at - node.start
        upper = Node(node.keys[:cut], at, parent, node.last_used)
        upper.evicted = node.evicted
        parent.children[upper.keys[0]] = upper
        node.keys = node.keys[cut:]
        node.parent = upper
        upper.children[node.keys[0]] = node
        old = self.take_snapshots(node)
        if old:
            halves = [
                (None, None) if s is None else _split(layer, s, at)
                for layer, s in zip(self.layers, old, strict=True)
            ]
            self.set_snapshots(upper, [h[0] for h in halves])
            self.set_snapshots(node, [h[1] for h in halves])
        return upper

    def merge_with_child(self, node: Node) -> None:
        """Fold the node's only child into it (edges joined, snapshots merged)."""
        if len(node.children) != 1 or node is self.root:
            raise ValueError(f"cannot merge {node} with {len(node.children)} children")
        (child,) = node.children.values()
        upper, lower = self.take_snapshots(node), self.take_snapshots(child)
        if upper or lower:
            empty: list[Snapshot | None] = [None] * len(self.layers)
            merged = [
                layer.merge(a, b)
                for layer, a, b in zip(self.layers, upper or empty, lower or empty, strict=True)
            ]
            self.set_snapshots(node, merged)
        node.keys += child.keys
        node.end = child.end
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        node.last_used = max(node.last_used, child.last_used)
        child.parent, child.children = None, {}

    def remove_leaf(self, node: Node) -> None:
        parent = node.parent
        if parent is None or node.children:
            raise ValueError(f"{node} is not a leaf")
        del parent.children[node.keys[0]]
        node.parent = None
        self.set_snapshots(node, [])

    def advance(
        self,
        frontier: Node,
        keys: Sequence[Key],
        last_used: int,
        pinned: Callable[[Node], bool] = Node.has_snapshots,
    ) -> list[Node]:
        """Record `keys` after `frontier`: follow matching children (splitting a partly
        matched one), then add the rest as a new node, or extend a bare leaf in place
        (one whose end no snapshot pins: `pinned`, asked only of a childless leaf).

        Returns the nodes now below `frontier` on this path, in order (possibly none when
        `frontier` itself grew).
        """
        added: list[Node] = []
        node, pos = frontier, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            n = _common_length(child.keys, keys, pos)
            if n < len(child.keys):
                child = self.split(child, child.start + n)
            added.append(child)
            node, pos = child, pos + n
        if pos < len(keys):
            rest = tuple(keys[pos:])
            if node is not self.root and not node.children and not pinned(node):
                # a bare leaf: no snapshot pins its end, so it can grow
                node.keys += rest
                node.end += len(rest)
            else:
                added.append(self.add_child(node, rest, last_used))
        return added

    # -- checks and display --

    def verify(self) -> None:
        """Raise AssertionError if a structural invariant is broken."""
        total = 0
        for node in self.walk():
            total += node.snapshot_bytes()
            _verify_node(node, self.root, len(self.layers))
        if total != self.paged_bytes:
            raise AssertionError(f"paged bytes {self.paged_bytes} != held {total}")

    def dump(self, active: Sequence[Node] = ()) -> str:
        on_path = {id(n) for n in active}
        lines: list[str] = []
        stack: list[tuple[Node, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            held = sum(s is not None for s in node.snapshots)
            flags = f" snap {held}/{len(self.layers)} {node.snapshot_bytes()}B" if held else ""
            on_disk = sum(isinstance(s, DeferredSnapshot) for s in node.snapshots)
            flags += f" ({on_disk} on disk)" if on_disk else ""
            flags += " *" if id(node) in on_path else ""
            lines.append(f"{'  ' * depth}[{node.start},{node.end}) {len(node.keys)}t{flags}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)


def _split(layer: LayerCache, snap: Snapshot, at: int) -> tuple[Snapshot | None, Snapshot | None]:
    if isinstance(snap, DeferredSnapshot):
        return snap.split_at(at)
    return layer.split(snap, at)


def _verify_node(node: Node, root: Node, layers: int) -> None:
    def fail(why: str) -> None:
        raise AssertionError(f"{node}: {why}")

    if node is root:
        if node.keys or node.end or node.snapshots or node.parent is not None:
            fail("root must be empty")
    else:
        if not node.keys:
            fail("empty edge")
        if node.parent is None or node.start != node.parent.end:
            fail("start differs from the parent's end")
    for first, child in node.children.items():
        if child.parent is not node or child.keys[:1] != (first,):
            fail(f"child {child} filed under the wrong key or parent")
    if node.snapshots and len(node.snapshots) != layers:
        fail("snapshot list of the wrong length")
    for snap in node.snapshots:
        if snap is None:
            continue
        if snap.closed:
            fail("holds a closed snapshot")
        if snap.end != node.end or snap.base > node.start or snap.floor > snap.end:
            fail(f"snapshot {snap} does not restore to the node's end")
