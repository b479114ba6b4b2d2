"""The `trie` part of GET /admin/state: the prefix trie as a tree of shared prefixes, from
the frozen copy the engine publishes (runtime/prefix/view.py), with the paths the recent
requests took through it.

    "trie": {
      "as_of": 1718000000.1,        wall clock when a step last changed the trie
      "stats": {...},               the counters /debug/prefix-cache shows
      "pins": [...],                the live pins (cache_control breakpoints, prompt_cache_key)
      "nodes_total": 12,            nodes in the trie; `nodes` holds the 512 shallowest
      "nodes": [{                   parents before children; nodes[0] is the root
        "id": 3, "parent": 1,       indexes into `nodes` (the root's parent is null)
        "start": 40, "end": 57,     the token offsets its edge spans
        "tokens": 17,               end - start
        "memory_bytes": 8192,       snapshot bytes it holds in memory
        "layers": 1, "disk_layers": 0,   layers with a snapshot; of those, on disk
        "live": true,               on the live path (the caches hold its tokens now)
        "pinned": false,            holds a pinned prompt's tokens
        "evicted": false,           eviction dropped state it had
        "next_eviction": false,     what eviction would take next
        "last_used": 9,             the cache's clock when last used (larger: more recent)
        "requests": [4, 5],         recent requests (their `id`) whose tokens pass through it
        "reused_by": [5],           of those, the ones that reused (part of) it
        "text": "<|im_start|>..."   its edge decoded, shortened (only when prompts are shown)
      }]
    }
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from runtime.engine import CacheView, RequestRecord
from runtime.prefix import Key, NodeView, keys_text

Decode = Callable[[Sequence[int]], str]

HEAD_TOKENS = 48  # a long edge shows its first tokens ...
TAIL_TOKENS = 16  # ... and its last


def short_text(keys: Sequence[Key], decode: Decode) -> str:
    if len(keys) <= HEAD_TOKENS + TAIL_TOKENS:
        return keys_text(keys, decode)
    head = keys_text(keys[:HEAD_TOKENS], decode)
    return f"{head} … {keys_text(keys[-TAIL_TOKENS:], decode)}"


def _common(edge: tuple[Key, ...], keys: Sequence[Key], pos: int) -> int:
    n = min(len(edge), len(keys) - pos)
    if tuple(keys[pos : pos + n]) == edge[:n]:
        return n
    i = 0
    while i < n and edge[i] == keys[pos + i]:
        i += 1
    return i


def path_of(
    keys: Sequence[Key], nodes: Sequence[NodeView], kids: list[dict[Key, int]]
) -> list[int]:
    """The nodes (indexes, the root left out) that `keys` pass through."""
    path: list[int] = []
    at, pos = 0, 0
    while pos < len(keys):
        child = kids[at].get(keys[pos])
        if child is None:
            break
        n = _common(nodes[child].keys, keys, pos)
        path.append(child)
        pos += n
        if n < len(nodes[child].keys):
            break
        at = child
    return path


def trie_body(
    view: CacheView, recent: Sequence[RequestRecord], decode: Decode | None
) -> dict[str, Any]:
    """The trie's JSON (see the module docstring); `decode` None leaves the text out."""
    nodes = view.tree.nodes
    kids: list[dict[Key, int]] = [{} for _ in nodes]
    for node in nodes[1:]:
        kids[node.parent][node.keys[0]] = node.index
    through: list[list[int]] = [[] for _ in nodes]
    reused: list[list[int]] = [[] for _ in nodes]
    for record in recent:
        for index in path_of(record.keys, nodes, kids):
            through[index].append(record.id)
            if nodes[index].start < record.cached_tokens:
                reused[index].append(record.id)
    out = []
    for node in nodes:
        entry: dict[str, Any] = {
            "id": node.index,
            "parent": None if node.parent < 0 else node.parent,
            "start": node.start,
            "end": node.end,
            "tokens": len(node.keys),
            "memory_bytes": node.memory_bytes,
            "layers": node.layers,
            "disk_layers": node.disk_layers,
            "live": node.live,
            "pinned": node.pinned,
            "evicted": node.evicted,
            "next_eviction": node.next_eviction,
            "last_used": node.last_used,
            "requests": through[node.index],
            "reused_by": reused[node.index],
        }
        if decode is not None:
            entry["text"] = short_text(node.keys, decode)
        out.append(entry)
    return {
        "as_of": round(view.at, 3),
        "stats": view.stats,
        "pins": view.pins,
        "nodes_total": view.tree.total,
        "nodes": out,
    }
