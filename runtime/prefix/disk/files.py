"""The prefix cache's files on disk: one paged-out trie node per safetensors file.

A file holds the node's key path from the root (token ids, with image spans as runs of
content-hash keys), and for each layer it covers the snapshot's numbers and arrays. Its
metadata names the format, the layout version and the model's identity (a hash of the
weights' and config's names, sizes and mtimes, the dtype and device), so state computed
by another model, or by an older layout, is never read into this one. Every tensor has a
CRC-32 and the metadata one of its own, checked when the file is read: a truncated or
corrupted file raises `BadEntry`, and the caller deletes it.

Writes are atomic: a temporary file (`*.tmp`, never read) is written, fsynced and
renamed over the final name, then the directory is fsynced. A process killed mid-write
leaves only a temporary file, which the next start deletes.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from runtime.cache import codec
from runtime.prefix.trie import ImageKey, Key

FORMAT = "mlx-gateway-prefix-cache"
LAYOUT_VERSION = 1  # bump when what a file means changes
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
KEYS = "keys"

# what identifies a model's weights and how its state is computed
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".npz")
_CONFIG_NAMES = ("config.json", "tokenizer.json", "tokenizer_config.json")


class BadEntry(Exception):
    """A file that must not be loaded: truncated, corrupted, or another model's."""


@dataclass(frozen=True)
class LayerMeta:
    """One layer's snapshot in a file: its numbers and its arrays' dtypes and shapes."""

    layout: codec.Layout
    base: int
    floor: int
    end: int
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.layout.kind,
            "params": dict(self.layout.params),
            "base": self.base,
            "floor": self.floor,
            "end": self.end,
            "dtypes": list(self.dtypes),
            "shapes": [list(s) for s in self.shapes],
        }

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> LayerMeta:
        params = {str(k): int(v) for k, v in dict(raw["params"]).items()}
        return cls(
            codec.Layout(str(raw["kind"]), params),
            int(raw["base"]),
            int(raw["floor"]),
            int(raw["end"]),
            tuple(str(d) for d in raw["dtypes"]),
            tuple(tuple(int(n) for n in s) for s in raw["shapes"]),
        )


@dataclass(frozen=True)
class Header:
    """What a file says about itself (everything but the arrays)."""

    end: int
    layers: Mapping[int, LayerMeta]
    check: int  # CRC-32 of the metadata: tells this file from a rewritten one
    sums: Mapping[str, int]


# -- identity --


def model_identity(source: Path, *extra: str) -> str:
    """A hash of the model's weight, config and tokenizer files (names, sizes, mtimes),
    the layout version and `extra` (dtype, device: what else changes the state)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{FORMAT}/{LAYOUT_VERSION}\0".encode())
    files = [source] if source.is_file() else sorted(source.iterdir()) if source.is_dir() else []
    for path in files:
        if not path.is_file():
            continue
        if path.suffix not in _WEIGHT_SUFFIXES and path.name not in _CONFIG_NAMES:
            continue
        st = path.stat()
        digest.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for part in extra:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


# -- keys --


def encode_keys(keys: Sequence[Key]) -> tuple[np.ndarray, list[list[Any]]]:
    """Token ids as int32 (-1 at image positions) and the image runs, each
    [position, digest, first index, count]; ValueError for an id int32 cannot hold."""
    runs: list[list[Any]] = []
    try:
        tokens = np.asarray(keys, dtype=np.int64)
    except TypeError:  # image keys among the ids
        tokens, runs = _with_images(keys)
    except OverflowError:
        raise ValueError("token ids must lie in [0, 2**31)") from None
    low = -1 if runs else 0
    if tokens.ndim != 1 or (tokens.size and (tokens.max() >= 2**31 or tokens.min() < low)):
        raise ValueError("token ids must lie in [0, 2**31)")
    return tokens.astype(np.int32), runs


def _with_images(keys: Sequence[Key]) -> tuple[np.ndarray, list[list[Any]]]:
    ids: list[int] = []
    runs: list[list[Any]] = []
    for pos, key in enumerate(keys):
        if isinstance(key, int):
            if key < 0:
                raise ValueError("token ids must lie in [0, 2**31)")
            ids.append(key)
            continue
        ids.append(-1)
        last = runs[-1] if runs else None
        if (
            last is not None
            and last[1] == key.digest
            and last[0] + last[3] == pos
            and last[2] + last[3] == key.index
        ):
            last[3] += 1
        else:
            runs.append([pos, key.digest, key.index, 1])
    return np.array(ids, dtype=np.int64), runs


def decode_keys(tokens: np.ndarray, runs: Sequence[Sequence[Any]]) -> tuple[Key, ...]:
    """The keys `encode_keys` took apart; ValueError when the runs do not fit."""
    keys: list[Key] = [int(t) for t in tokens.tolist()]
    for pos, digest, first, count in runs:
        pos, first, count = int(pos), int(first), int(count)
        if count < 1 or pos < 0 or pos + count > len(keys) or first < 0:
            raise ValueError("an image run outside the keys")
        for j in range(count):
            if keys[pos + j] != -1:
                raise ValueError("an image run over token ids")
            keys[pos + j] = ImageKey(str(digest), first + j)
    if any(k == -1 for k in keys if isinstance(k, int)):
        raise ValueError("an image position without an image")
    return tuple(keys)


# -- arrays --


def export(array: mx.array) -> tuple[np.ndarray, mx.array]:
    """A zero-copy numpy view of an array, for the writer thread (files only, no MLX),
    and the MLX array it views (bfloat16, which numpy lacks, as its bits): the caller
    keeps that alive until the write is done, and releases it on the MLX thread."""
    bits = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    mx.eval(bits)
    return np.asarray(bits), bits


def dtype_name(array: mx.array) -> str:
    return str(array.dtype).removeprefix("mlx.core.")


def tensor_name(layer: int, index: int) -> str:
    return f"l{layer}.{index}"


def content_name(tokens: np.ndarray, runs: list[list[Any]], layers: Mapping[int, LayerMeta]) -> str:
    """The file name for this state: the same keys and snapshots always get the same one,
    so a state already on disk is never written twice."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(tokens.tobytes())
    described = {str(i): m.describe() for i, m in sorted(layers.items())}
    digest.update(json.dumps([runs, described], sort_keys=True).encode())
    return digest.hexdigest()


# -- writing --


def size_bound(tokens: np.ndarray, runs: list[list[Any]], layers: Mapping[int, LayerMeta]) -> int:
    """An upper bound on the size of the file `write_entry` makes: the arrays, plus the
    header (its metadata, with room for the checksums, and a generous line per tensor)."""
    data = tokens.nbytes
    tensors = 1
    for meta in layers.values():
        tensors += len(meta.shapes)
        for shape, dtype in zip(meta.shapes, meta.dtypes, strict=True):
            data += int(np.prod(shape, dtype=np.int64)) * _ITEM_BYTES.get(dtype, 8)
    described = json.dumps({str(i): m.describe() for i, m in layers.items()})
    return data + len(json.dumps(runs)) + len(described) + 256 * tensors + 1024


_ITEM_BYTES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "uint32": 4, "uint16": 2, "int8": 1,
}  # fmt: skip


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).data) & 0xFFFFFFFF


def _meta_check(fields: Mapping[str, str]) -> int:
    text = json.dumps({k: fields[k] for k in sorted(fields) if k != "check"}, sort_keys=True)
    return zlib.crc32(text.encode()) & 0xFFFFFFFF


def write_entry(
    path: Path,
    identity: str,
    header: Header,
    tokens: np.ndarray,
    runs: list[list[Any]],
    arrays: Mapping[int, Sequence[np.ndarray]],
) -> tuple[Header, int]:
    """Write a node's file atomically (see the module docstring); return its header, with
    the checksums now known, and its size."""
    tensors = {KEYS: tokens}
    for layer, group in arrays.items():
        for j, array in enumerate(group):
            tensors[tensor_name(layer, j)] = array
    sums = {name: _crc(t) for name, t in sorted(tensors.items())}
    fields = {
        "format": FORMAT,
        "version": str(LAYOUT_VERSION),
        "model": identity,
        "end": str(header.end),
        "images": json.dumps(runs),
        "layers": json.dumps({str(i): m.describe() for i, m in sorted(header.layers.items())}),
        "sums": json.dumps(sums),
    }
    check = _meta_check(fields)
    fields["check"] = str(check)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        save_file(tensors, str(tmp), metadata=fields)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent)  # the rename itself must survive a crash
    return Header(header.end, header.layers, check, sums), path.stat().st_size


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading --


def read_header(path: Path, identity: str) -> tuple[Header, tuple[Key, ...]]:
    """The file's header and key path, checked; BadEntry when it must not be used."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            fields = f.metadata() or {}
            _check_fields(fields, identity)
            sums = {str(k): int(v) for k, v in json.loads(fields["sums"]).items()}
            tokens = f.get_tensor(KEYS)
            if _crc(tokens) != sums.get(KEYS):
                raise BadEntry("its keys fail their checksum")
            layers = {int(i): LayerMeta.parse(m) for i, m in json.loads(fields["layers"]).items()}
            names = set(f.keys())
        end = int(fields["end"])
        keys = decode_keys(tokens, json.loads(fields["images"]))
    except BadEntry:
        raise
    except Exception as exc:  # safetensors, json, a missing field: all mean damaged
        raise BadEntry(f"unreadable ({type(exc).__name__}: {exc})") from None
    if end < 1 or len(keys) != end or not layers or any(m.end != end for m in layers.values()):
        raise BadEntry("its keys and snapshots disagree on where they end")
    expected = {KEYS, *(tensor_name(i, j) for i, m in layers.items() for j in range(len(m.dtypes)))}
    if names != expected or set(sums) != expected:
        raise BadEntry("its tensors do not match its layers")
    return Header(end, layers, int(fields["check"]), sums), keys


def _check_fields(fields: Mapping[str, str], identity: str) -> None:
    if fields.get("format") != FORMAT:
        raise BadEntry("not a prefix-cache file")
    if fields.get("version") != str(LAYOUT_VERSION):
        raise BadEntry(f"cache layout {fields.get('version')}, this server writes {LAYOUT_VERSION}")
    if fields.get("model") != identity:
        raise BadEntry("written for another model (or other weights, dtype or device)")
    if str(_meta_check(fields)) != fields.get("check"):
        raise BadEntry("its metadata fails its checksum")


def read_layers(
    path: Path, identity: str, header: Header, layers: Iterable[int]
) -> dict[int, list[mx.array]]:
    """The arrays of `layers`, evaluated, each checked against its checksum, dtype and
    shape. The header is validated first (the file must be whole); then MLX reads just
    the tensors asked for, straight into its arrays."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            fields = f.metadata() or {}
        _check_fields(fields, identity)
        if int(fields["check"]) != header.check:
            raise BadEntry("the file changed since it was indexed")
        loaded = mx.load(str(path))  # lazy: only what is evaluated is read
        assert isinstance(loaded, dict)
        groups = {
            layer: [loaded[tensor_name(layer, j)] for j in range(len(header.layers[layer].dtypes))]
            for layer in layers
        }
        mx.eval([a for group in groups.values() for a in group])
        return {layer: _verified(layer, group, header) for layer, group in groups.items()}
    except BadEntry:
        raise
    except Exception as exc:
        raise BadEntry(f"unreadable ({type(exc).__name__}: {exc})") from None


def _verified(layer: int, group: list[mx.array], header: Header) -> list[mx.array]:
    meta = header.layers[layer]
    out: list[mx.array] = []
    for j, (array, dtype) in enumerate(zip(group, meta.dtypes, strict=True)):
        if _crc(np.asarray(array)) != header.sums[tensor_name(layer, j)]:
            raise BadEntry(f"layer {layer} fails its checksum")
        if tuple(array.shape) != meta.shapes[j]:
            raise BadEntry(f"layer {layer} has shape {tuple(array.shape)}, not {meta.shapes[j]}")
        if dtype == "bfloat16" and array.dtype == mx.uint16:
            array = array.view(mx.bfloat16)
        elif dtype_name(array) != dtype:
            raise BadEntry(f"layer {layer} holds {dtype_name(array)}, not {dtype}")
        out.append(array)
    mx.eval(out)
    return out
