"""Pooling an encoder's token states into one embedding per input, as
sentence-transformers' Pooling and Normalize modules do: [CLS] token, mean, max, mean
over sqrt(length), last token, several of them concatenated in that order; then, when
the model's pipeline normalizes, to unit length.

`Pooling.from_config` reads a Pooling module's config.json (1_Pooling/config.json);
the loader (runtime/load/encoder.py) reads the files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import mlx.core as mx

from runtime.models.encoder import first_token, key_mask


class PoolingMode(str, Enum):
    CLS = "cls"
    MAX = "max"
    MEAN = "mean"
    MEAN_SQRT_LEN = "mean_sqrt_len"
    LAST = "lasttoken"


# sentence-transformers' config keys, in the order it concatenates the modes
_CONFIG_KEYS = (
    ("pooling_mode_cls_token", PoolingMode.CLS),
    ("pooling_mode_max_tokens", PoolingMode.MAX),
    ("pooling_mode_mean_tokens", PoolingMode.MEAN),
    ("pooling_mode_mean_sqrt_len_tokens", PoolingMode.MEAN_SQRT_LEN),
    ("pooling_mode_lasttoken", PoolingMode.LAST),
)
_UNSUPPORTED_KEYS = ("pooling_mode_weightedmean_tokens",)


@dataclass(frozen=True)
class Pooling:
    modes: tuple[PoolingMode, ...] = (PoolingMode.MEAN,)
    normalize: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, normalize: bool = False) -> Pooling:
        """From sentence-transformers' Pooling config.json (its `pooling_mode_*` flags)."""
        for key in _UNSUPPORTED_KEYS:
            if config.get(key):
                raise ValueError(f"pooling {key.removeprefix('pooling_mode_')} is not supported")
        if config.get("include_prompt") is False:
            raise ValueError("pooling with include_prompt false is not supported")
        modes = tuple(mode for key, mode in _CONFIG_KEYS if config.get(key))
        if not modes:
            raise ValueError("the pooling config turns on no pooling mode")
        return cls(modes, normalize)

    def width(self, hidden: int) -> int:
        """The embedding's size for `hidden`-wide token states."""
        return hidden * len(self.modes)


def pool(hidden: mx.array, padding: Sequence[int], pooling: Pooling) -> mx.array:
    """(B, L, D) states of left-padded rows -> (B, width) embeddings (float32)."""
    hidden = hidden.astype(mx.float32)
    mask = key_mask(padding, hidden.shape[1])[:, :, None]
    counts = mx.array([hidden.shape[1] - p for p in padding], dtype=mx.float32)[:, None]
    parts = []
    for mode in pooling.modes:
        if mode is PoolingMode.CLS:
            parts.append(first_token(hidden, padding))
        elif mode is PoolingMode.MAX:
            low = mx.array(mx.finfo(mx.float32).min, dtype=mx.float32)
            parts.append(mx.max(mx.where(mask, hidden, low), axis=1))
        elif mode is PoolingMode.LAST:
            parts.append(hidden[:, -1])  # left padding: every row ends at the last column
        else:
            total = mx.sum(mx.where(mask, hidden, 0.0), axis=1)
            counts = mx.maximum(counts, 1e-9)
            div = counts if mode is PoolingMode.MEAN else mx.sqrt(counts)
            parts.append(total / div)
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return normalized(out) if pooling.normalize else out


def normalized(x: mx.array) -> mx.array:
    """Rows scaled to unit length (torch's F.normalize: a zero row stays zero)."""
    norms = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
    return x / mx.maximum(norms, 1e-12)
