"""The shared prefix trie: conversations that share a prefix reuse its computed state.

`PrefixCache` (cache.py) is what the batch and the engine call; a request's use of the
live caches is a `Lease`, and what it reused is a `CacheReport`. The disk tier lives in
runtime/prefix/disk/.
"""

from __future__ import annotations

from runtime.prefix.cache import Lease, PrefixCache
from runtime.prefix.disk import DiskTier, model_identity
from runtime.prefix.loan import RowState
from runtime.prefix.plan import Plan, plan_restore
from runtime.prefix.report import CacheReport, MissReason, keys_text
from runtime.prefix.trie import ImageKey, Key, Node, image_keys
from runtime.prefix.view import NodeView, TrieView

__all__ = [
    "CacheReport",
    "DiskTier",
    "ImageKey",
    "Key",
    "Lease",
    "MissReason",
    "Node",
    "NodeView",
    "Plan",
    "PrefixCache",
    "RowState",
    "TrieView",
    "image_keys",
    "keys_text",
    "model_identity",
    "plan_restore",
]
