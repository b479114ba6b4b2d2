"""What MLX's allocator holds in this process: the arrays alive, the freed buffers it
keeps for reuse (bounded by `mx.set_cache_limit`, RunnerSettings.buffer_cache_bytes) and
the most it ever held. The buffer cache counts in resident memory: a process whose
resident size rose by what its cache took has not leaked."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class AllocatorBytes:
    active: int
    cache: int
    peak: int


def allocator_bytes() -> AllocatorBytes:
    return AllocatorBytes(
        active=int(mx.get_active_memory()),
        cache=int(mx.get_cache_memory()),
        peak=int(mx.get_peak_memory()),
    )
