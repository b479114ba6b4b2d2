"""A Qwen3 embedding model or reranker from a GGUF file, as llama.cpp's
convert_hf_to_gguf.py writes one: `general.architecture` qwen3 with a
`qwen3.pooling_type` (which a chat model's file does not have). The converter writes it
from the folder's sentence-transformers Pooling config (3, last token, for
Qwen3-Embedding), or 4 (rank) for Qwen3-Reranker, whose LM head it cuts down to the
"yes" and "no" rows (`cls.output.weight`, yes first).

Read here: the HF config (runtime/load/gguf/config.py), the weights under HF names,
dequantized to float32, the tokenizer (runtime/load/gguf/tokenizer.py) and the pooling.
As for a BERT GGUF (runtime/load/gguf/encoder.py), the embeddings are normalized, what
llama.cpp's server does by default and what Qwen3-Embedding's own pipeline does; the
loader makes the tokenizer end each input with <|endoftext|> (the token the pooling
reads: runtime/load/decoder_encoder.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.load.gguf.config import hf_config
from runtime.load.gguf.encoder import gguf_architecture
from runtime.load.gguf.names import hf_name
from runtime.load.gguf.quants import dequantize
from runtime.load.gguf.reader import GGUFFile
from runtime.load.gguf.tokenizer import tokenizer_from_gguf
from runtime.models import DecoderHead, Pooling, PoolingMode
from runtime.text import Tokenizer

ARCHITECTURE = "qwen3"
_POOLING_KEY = f"{ARCHITECTURE}.pooling_type"
# llama.cpp's enum llama_pooling_type
_POOLING = {1: PoolingMode.MEAN, 2: PoolingMode.CLS, 3: PoolingMode.LAST}
_RANK = 4
_ANSWER = "cls.output.weight"
_HEAD_BYTES = 1 << 20
# GGUF's scalar value types -> struct formats
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
    11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFDecoderEncoder:
    config: dict[str, Any]  # as config.json would have it
    weights: dict[str, np.ndarray]  # HF names (the reranker's rows as answer.weight)
    tokenizer: Tokenizer
    head: DecoderHead
    pooling: Pooling | None  # an embedding model's


def is_gguf_decoder_encoder(path: Path) -> bool:
    """Whether `path` is a qwen3 GGUF with a pooling type (read from the file's head:
    the converter writes the hyperparameters before the tokenizer's long arrays)."""
    if not path.is_file() or gguf_architecture(path) != ARCHITECTURE:
        return False
    found = _head_value(path, _POOLING_KEY)
    if found is _UNKNOWN:
        found = GGUFFile(path).get(_POOLING_KEY)
    return isinstance(found, int) and (found in _POOLING or found == _RANK)


def gguf_decoder_scores(path: Path) -> bool:
    """Whether a qwen3 GGUF encoder is a reranker (pooling type rank), not an embedder."""
    found = _head_value(path, _POOLING_KEY)
    if found is _UNKNOWN:
        found = GGUFFile(path).get(_POOLING_KEY)
    return found == _RANK


def read_gguf_decoder_encoder(path: Path) -> GGUFDecoderEncoder:
    """The parts of a qwen3 GGUF embedding model or reranker (see the module docstring)."""
    gf = GGUFFile(path)
    kind = gf.get(_POOLING_KEY)
    if gf.architecture != ARCHITECTURE or not (kind in _POOLING or kind == _RANK):
        raise ValueError(f"{path}: not a qwen3 GGUF with a pooling type this server reads")
    config = hf_config(gf)
    weights: dict[str, np.ndarray] = {}
    for name, info in gf.tensors.items():
        ours = "answer.weight" if name == _ANSWER else hf_name(name, ARCHITECTURE)
        if ours is None:
            raise ValueError(f"{path}: tensor {name!r} is not a qwen3 weight read here")
        weights[ours] = dequantize(gf.raw(name), info.ggml_type, info.shape)
    if kind == _RANK:
        if "answer.weight" not in weights or weights["answer.weight"].shape[0] != 2:
            raise ValueError(f"{path}: a rank GGUF needs its yes/no rows ({_ANSWER}, 2 rows)")
        return GGUFDecoderEncoder(
            config, weights, tokenizer_from_gguf(gf), DecoderHead.YES_NO, None
        )
    pooling = Pooling((_POOLING[int(kind)],), normalize=True)
    return GGUFDecoderEncoder(config, weights, tokenizer_from_gguf(gf), DecoderHead.NONE, pooling)


_UNKNOWN = object()


def _head_value(path: Path, wanted: str) -> Any:
    """`wanted`'s value when it is a plain number among the key/value pairs before the
    first `tokenizer.` key; None when it is not there; _UNKNOWN when the pairs run past
    the bytes read (the caller parses the file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD_BYTES)
        at, count = 24, struct.unpack_from("<Q", head, 16)[0]
        for _ in range(count):
            (size,) = struct.unpack_from("<Q", head, at)
            key = head[at + 8 : at + 8 + size].decode("utf-8")
            (kind,) = struct.unpack_from("<I", head, at + 8 + size)
            at += 12 + size
            if key.startswith("tokenizer."):
                return None
            if key == wanted and kind in _SCALARS:
                return struct.unpack_from(_SCALARS[kind], head, at)[0]
            at = _skip(head, at, kind)
    except (struct.error, UnicodeDecodeError, KeyError):
        return _UNKNOWN
    return None


def _skip(head: bytes, at: int, kind: int) -> int:
    """The offset after a value of GGUF type `kind` at `at`."""
    if kind == _STRING:
        return at + 8 + int(struct.unpack_from("<Q", head, at)[0])
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", head, at)
        at += 12
        if item in _SCALARS:
            return at + struct.calcsize(_SCALARS[item]) * int(count)
        for _ in range(count):
            at = _skip(head, at, item)
        return at
    return at + struct.calcsize(_SCALARS[kind])
