"""Per-layer caches, their snapshots, and the protocol models and the prefix trie use;
the batched and ragged forms the scheduler runs a batch on.

The disk tier's snapshot encoding is the `codec` module (`codec.encode`, `codec.decode`,
`codec.Layout`): its generic names would read as this package's own verbs otherwise."""

from __future__ import annotations

from runtime.cache import codec
from runtime.cache.batch import (
    BatchCaches,
    BatchQuantizedCache,
    BatchTokenCache,
    RowView,
    batchable,
)
from runtime.cache.kv import KVCache, KVSnapshot, reserve_prompt
from runtime.cache.latent import LatentCache
from runtime.cache.mask import Mask, window_mask
from runtime.cache.protocol import ArraySnapshot, Cache, LayerCache, Snapshot
from runtime.cache.quantized import (
    KV_BITS,
    Quantized,
    QuantizedKVCache,
    QuantizedSnapshot,
    quantizing,
    rotate,
)
from runtime.cache.ragged import RaggedCache
from runtime.cache.recurrent import RecurrentCache, RecurrentSnapshot, RecurrentState
from runtime.cache.rotating import RotatingKVCache, RotatingSnapshot
from runtime.cache.rows import BatchQuantizedRows, RowTokenCache, Writer

__all__ = [
    "KV_BITS",
    "ArraySnapshot",
    "BatchCaches",
    "BatchQuantizedCache",
    "BatchQuantizedRows",
    "BatchTokenCache",
    "Cache",
    "KVCache",
    "KVSnapshot",
    "LatentCache",
    "LayerCache",
    "Mask",
    "Quantized",
    "QuantizedKVCache",
    "QuantizedSnapshot",
    "RaggedCache",
    "RecurrentCache",
    "RecurrentSnapshot",
    "RecurrentState",
    "RotatingKVCache",
    "RotatingSnapshot",
    "RowTokenCache",
    "RowView",
    "Snapshot",
    "Writer",
    "batchable",
    "codec",
    "quantizing",
    "reserve_prompt",
    "rotate",
    "window_mask",
]
