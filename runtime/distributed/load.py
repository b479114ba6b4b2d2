"""Load a rank's part of a model: the loader's machinery with a shard step before evaluation.

MLX reads a safetensors tensor only when something evaluates it. The loader builds the
model and loads every weight lazily; `shard_model` then replaces each weight by this
rank's slice (a copy of it) and drops the layers of other pipeline stages, and the
checkpoint's own references are gone by then (runtime/load/loaded.py `finish_model`).
Evaluating one layer at a time afterwards bounds what is briefly held in full to one layer's
tensors: a rank's memory holds its part, never the whole model.

A GGUF file is converted to arrays by numpy as it is read, so a GGUF rank does pass
through the whole model once (it keeps only its part).
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx

from runtime.distributed.group import GroupLike, handle_of
from runtime.distributed.pipeline import parameter_bytes
from runtime.distributed.shard import Mode, shard_info, shard_model
from runtime.load import LoadedModel, QuantizeSpec, load
from runtime.models.base import LanguageModel

log = logging.getLogger(__name__)


def load_sharded(
    source: str | Path,
    group: GroupLike,
    mode: Mode,
    dtype: str | None = None,
    *,
    keep_quantized: bool | None = None,
    quantize: QuantizeSpec | None = None,
) -> LoadedModel:
    """`runtime.load.loader.load` of `source`, holding only this rank's part of the weights
    (see `shard_model` for `mode`); every rank must call it with the same arguments."""
    handle = handle_of(group)

    def shard(model: LanguageModel) -> None:
        whole = parameter_bytes(model)
        shard_model(model, group, mode)
        for layer in model.model.layers:  # type: ignore[attr-defined]
            mx.eval(layer.parameters())
        info = shard_info(model)
        log.info(
            "rank %d of %d: %s, %.1f of %.1f MB of weights",
            handle.rank(),
            handle.size(),
            info.describe() if info else mode,
            parameter_bytes(model) / 2**20,
            whole / 2**20,
        )

    return load(source, dtype=dtype, keep_quantized=keep_quantized, quantize=quantize, shard=shard)


__all__ = ["load_sharded"]
