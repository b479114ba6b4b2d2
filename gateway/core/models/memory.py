"""How much memory a model takes and how to give it back: the estimate from its weight
files before it loads, the measured size of its arrays after, the share of the budget its
caches get, the server's default budget, and the release after an unload.

One budget (--memory-budget) covers every loaded model's weights and caches: a model
counts as its weights plus its cache memory, the bound its running batch and its prefix
trie share (runtime/batch/scheduler.py gives the batch priority; the trie gives way, to its
disk tier when it has one)."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any

from gateway.core.models.served import ServedModel
from runtime.backend import trim_heap

log = logging.getLogger(__name__)

BUDGET_SHARE = 0.75  # of physical memory, for loaded models' weights and caches
CACHE_SHARE = 0.25  # of physical memory at most, per model, when several are configured
MIN_CACHE_BYTES = 256 * 1024**2  # a model's caches get at least this, whatever is left


def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): assume 16 GiB
        return 16 * 1024**3


def default_memory_budget() -> int:
    """About three quarters of RAM: the rest is for the process itself and the OS."""
    return int(physical_memory() * BUDGET_SHARE)


def cache_budget(budget: int, weights: int, models: int) -> int:
    """A model's cache memory (its running batch and its prefix trie in memory): with
    one model, all the budget leaves after its weights; with several, at most a quarter
    of RAM each, so that a few fit side by side."""
    room = budget - weights
    if models > 1:
        room = min(room, int(physical_memory() * CACHE_SHARE))
    return max(MIN_CACHE_BYTES, room)


def weight_file_bytes(path: Path) -> int:
    """The size of a model's weight files: the estimate of its memory before it loads (a
    quantized file dequantized on a CPU without our kernels takes more, a GGUF's 5-bit
    tensors stored as 8-bit on the CPU too; the measured size replaces it)."""
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".npz")]
    files = weights or [p for p in path.iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files if p.is_file())


def quantized_estimate(file_bytes: int, quantize: str | None, group_size: int) -> int:
    """The estimate of a model's weights under `--quantize` ("q4"/"q8"; None: the files'
    size): its files read as a 16-bit model's (bf16/f16, the usual source), each weight at
    the quantized width plus a float16 scale and bias per group. The measured size
    replaces it at the first load; until then it is what admission counts."""
    if quantize is None:
        return file_bytes
    bits = int(quantize.removeprefix("q")) + 32 / group_size
    return int(file_bytes * bits / 16)


def parameter_bytes(model: Any) -> int | None:
    """The bytes of a loaded model's parameters (metadata only: nothing is evaluated)."""
    try:
        from mlx.utils import tree_flatten

        leaves: dict[str, Any] = {}
        tree_flatten(model.parameters(), destination=leaves)
        return sum(int(v.nbytes) for v in leaves.values() if hasattr(v, "nbytes"))
    except Exception:  # a stand-in model in tests, or an unexpected tree: keep the estimate
        log.debug("could not measure a model's weights", exc_info=True)
        return None


def served_bytes(served: ServedModel) -> int | None:
    """What a loaded model counts against the budget: its weights (and its draft
    model's), measured, plus the cache memory its runner was given (None when the
    weights cannot be measured)."""
    weights = parameter_bytes(served.loaded.model)
    if weights is None:
        return None
    draft = getattr(served.runner, "draft", None)  # a draft model's weights count too
    if draft is not None:
        weights += parameter_bytes(draft.model) or 0
    settings = getattr(served.runner, "settings", None)
    return weights + int(getattr(settings, "cache_memory_bytes", 0) or 0)


def release_memory() -> None:
    """After the last reference to a model is dropped: collect what only the cycle
    collector finds, hand MLX's cached buffers back, and have glibc return the freed
    heap to the system. Without the trim the CPU backend's freed weights stay in the
    process (in the malloc arenas of the threads that loaded them), and every reload
    grew it by a model's size."""
    gc.collect()
    try:
        import mlx.core as mx

        mx.clear_cache()
    except ImportError:
        pass
    trim_heap()
