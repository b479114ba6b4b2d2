"""Reading GGUF files: header, metadata and tensor table, with tensor data as zero-copy views.

The ``gguf`` package's ``GGUFReader`` builds a Python object per array element, which
takes 2-9 s on files whose tokenizer holds 150k-260k strings. This reader walks the
header once with ``struct`` on an ``mmap``: numeric arrays become numpy views, string
arrays a list of ``str``, and tensor data stays in the mapping until someone converts it.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64, the key/value pairs, the tensor infos (name, n_dims u32, dims u64
each, ggml type u32, offset u64), padding to ``general.alignment`` (default 32), data.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type -> struct format for the scalar types.
_SCALAR_FORMATS: dict[int, str] = {
    0: "<B",  # uint8
    1: "<b",  # int8
    2: "<H",  # uint16
    3: "<h",  # int16
    4: "<I",  # uint32
    5: "<i",  # int32
    6: "<f",  # float32
    7: "<?",  # bool
    10: "<Q",  # uint64
    11: "<q",  # int64
    12: "<d",  # float64
}
_STRING = 8
_ARRAY = 9

# Tensor types whose elements are plain numbers (everything else is block-quantized).
_PLAIN_DTYPES: dict[int, np.dtype[Any]] = {
    int(GGMLQuantizationType.F32): np.dtype("<f4"),
    int(GGMLQuantizationType.F16): np.dtype("<f2"),
    int(GGMLQuantizationType.F64): np.dtype("<f8"),
    int(GGMLQuantizationType.I8): np.dtype("i1"),
    int(GGMLQuantizationType.I16): np.dtype("<i2"),
    int(GGMLQuantizationType.I32): np.dtype("<i4"),
    int(GGMLQuantizationType.I64): np.dtype("<i8"),
    # bfloat16 has no numpy dtype: expose the raw 16-bit words.
    int(GGMLQuantizationType.BF16): np.dtype("<u2"),
}

MetaValue = int | float | bool | str | list[str] | np.ndarray | list[Any]


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file; ``shape`` is in numpy order (rows first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in _PLAIN_DTYPES


class _Cursor:
    """Sequential little-endian reads over a buffer."""

    def __init__(self, buf: mmap.mmap, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> MetaValue:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        value: MetaValue = self.scalar(fmt)
        return value

    def array(self) -> MetaValue:
        etype = self.scalar("<I")
        count = self.scalar("<Q")
        if etype == _STRING:
            return self._strings(count)
        if etype == _ARRAY:
            return [self.array() for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(etype)
        if fmt is None:
            raise GGUFError(f"unknown GGUF array element type {etype}")
        dtype = np.dtype(fmt)
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return out

    def _strings(self, count: int) -> list[str]:
        # The hot loop of the whole reader (one iteration per vocabulary entry).
        buf, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


class GGUFFile:
    """A parsed GGUF: ``metadata`` (key -> value), ``tensors`` (name -> TensorInfo).

    Numeric metadata arrays are read-only numpy views into the file mapping; tensor data
    is read with :meth:`raw` (also a view). The mapping lives as long as this object or
    any view taken from it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._map)
        if self._map[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {self._map[:4]!r})")
        cur.pos = 4
        self.version: int = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        metadata: dict[str, MetaValue] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        self.metadata: Mapping[str, MetaValue] = metadata
        self.tensors: dict[str, TensorInfo] = self._read_tensor_table(cur, n_tensors)

    def _read_tensor_table(self, cur: _Cursor, n_tensors: int) -> dict[str, TensorInfo]:
        entries: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, cur.pos)
            cur.pos += 8 * n_dims
            ggml_type = cur.scalar("<I")
            offset = cur.scalar("<Q")
            # ggml lists the fastest-varying dimension first; numpy wants it last.
            entries.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        alignment = int(self.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in entries:
            nbytes = _tensor_nbytes(shape, ggml_type, name)
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
            tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
        return tensors

    # -- metadata helpers -------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", "llama"))

    def arch_get(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}``, the per-architecture hyperparameters."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    # -- tensor data ------------------------------------------------------------------

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident memory once it is
        converted: the mapping's pages count as resident while mapped (a 7B Q4_K_M file,
        4.7 GB, on top of the converted weights at the load's peak). The page cache keeps
        them and a later read faults them back in, so nothing changes but the count."""
        info = self.tensors[name]
        page = mmap.PAGESIZE
        start = info.offset // page * page
        end = min(len(self._map), -(-(info.offset + info.nbytes) // page) * page)
        advise = getattr(mmap, "MADV_DONTNEED", None)
        if advise is not None and end > start:
            self._map.madvise(advise, start, end - start)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a view: a typed array of ``shape`` for plain types,
        else uint8 of shape ``(*shape[:-1], bytes_per_row)`` (whole quant blocks per row)."""
        info = self.tensors[name]
        dtype = _PLAIN_DTYPES.get(info.ggml_type)
        if dtype is not None:
            count = info.nbytes // dtype.itemsize
            return np.frombuffer(self._map, dtype=dtype, count=count, offset=info.offset).reshape(
                info.shape
            )
        flat = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(*info.shape[:-1], -1)


def _tensor_nbytes(shape: tuple[int, ...], ggml_type: int, name: str) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:
        raise GGUFError(f"tensor {name}: unknown ggml type {ggml_type}") from exc
    if shape and shape[-1] % block:
        raise GGUFError(f"tensor {name}: row of {shape[-1]} is not whole {block}-blocks")
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    cols = shape[-1] if shape else 1
    return rows * (cols // block) * type_size
