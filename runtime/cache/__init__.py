"""Per-layer caches, their snapshots, and the protocol models and the prefix trie use."""

from __future__ import annotations

from runtime.cache.kv import KVCache, KVSnapshot
from runtime.cache.latent import LatentCache
from runtime.cache.mask import Mask, window_mask
from runtime.cache.protocol import ArraySnapshot, Cache, LayerCache, Snapshot
from runtime.cache.recurrent import RecurrentCache, RecurrentSnapshot, RecurrentState
from runtime.cache.rotating import RotatingKVCache, RotatingSnapshot

__all__ = [
    "ArraySnapshot",
    "Cache",
    "KVCache",
    "KVSnapshot",
    "LatentCache",
    "LayerCache",
    "Mask",
    "RecurrentCache",
    "RecurrentSnapshot",
    "RecurrentState",
    "RotatingKVCache",
    "RotatingSnapshot",
    "Snapshot",
    "window_mask",
]
