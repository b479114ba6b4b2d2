"""A GGUF's metadata (its key/value section) for tests that need a template or a token
from a real GGUF, read here without the gguf package's GGUFReader and without
runtime/load/gguf/reader.py (the code under test): GGUFReader builds numpy views for
every element of every array, about 10 s for Qwen2.5's 151k-token vocabulary on this
machine (twice that with the suite running), where this walk takes a fraction of one.

Layout (GGUF v2/v3, little-endian): "GGUF", u32 version, u64 tensor count, u64 key
count, then per key a string (u64 length, UTF-8 bytes), a u32 value type and the value;
an array is a u32 element type, a u64 count and the elements.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

# value type -> struct format of the fixed-size scalars
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class _Reader:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        start, self.pos = self.pos, self.pos + size
        return bytes(self.data[start : self.pos]).decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            return [self.value(etype) for _ in range(count)]
        return self.scalar(_SCALARS[vtype])


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of the GGUF at `path` with its value (arrays as lists)."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        reader = _Reader(data)
        assert bytes(data[:4]) == b"GGUF", f"{path} is not a GGUF"
        reader.pos = 4
        version = reader.scalar("<I")
        assert version in (2, 3), f"{path}: GGUF version {version}"
        reader.scalar("<Q")  # tensors
        count = reader.scalar("<Q")
        return {reader.string(): reader.value(reader.scalar("<I")) for _ in range(count)}
