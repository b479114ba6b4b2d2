"""Typed reads of a GGUF's ``{arch}.*`` hyperparameters (llama.cpp's ``gguf.constants.Keys``).

An optional key falls back to a default: what llama.cpp assumes when a file omits it. A key
the model cannot be built without is read with the ``require_*`` functions, whose error
names the full key, so a file that lacks it never loads as some other model.
"""

from __future__ import annotations

import numpy as np

from runtime.load.gguf.reader import GGUFFile


def _missing(gf: GGUFFile, key: str) -> ValueError:
    arch = gf.architecture
    return ValueError(f"{gf.path}: the GGUF has no {arch}.{key}, which a {arch} model needs")


def arch_int(gf: GGUFFile, key: str, default: int | None = None) -> int | None:
    value = gf.arch_get(key)
    if value is None:
        return default
    if isinstance(value, np.ndarray):
        # per-layer arrays (some converters): the model takes one value
        return int(value.max()) if value.size else default
    return int(value)


def arch_float(gf: GGUFFile, key: str, default: float | None = None) -> float | None:
    value = gf.arch_get(key)
    return default if value is None else float(value)


def arch_bool(gf: GGUFFile, key: str, default: bool) -> bool:
    value = gf.arch_get(key)
    return default if value is None else bool(value)


def require_int(gf: GGUFFile, key: str) -> int:
    value = arch_int(gf, key)
    if value is None:
        raise _missing(gf, key)
    return value


def require_float(gf: GGUFFile, key: str) -> float:
    value = arch_float(gf, key)
    if value is None:
        raise _missing(gf, key)
    return value
