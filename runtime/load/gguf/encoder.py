"""A BERT encoder from a GGUF file, as llama.cpp's convert_hf_to_gguf.py writes one
(`general.architecture` bert): its HF config, its weights under transformers' names,
its WordPiece tokenizer (runtime/load/gguf/tokenizer.py) and what it computes: an
embedding model's pooling (`bert.pooling_type`: mean, CLS or last token), or a
cross-encoder's classification head.

What the file does not say is chosen as llama.cpp's server does: the embeddings are
normalized (its default, and what the sentence-transformers models converted this way
do), and an input may hold the model's positions (`bert.context_length`), not
sentence-transformers' max_seq_length, which the converter does not write (a config's
context_length lowers it).

A cross-encoder is told by its head: the converter writes a *ForSequenceClassification's
labels (`bert.classifier.output_labels`) and its head as `cls` (a dense layer, tanh after
it) and `cls.output` (the projection to the labels); llama.cpp runs it under pooling type
rank, which the converter does not write for bert (a file may say it). A RoBERTa or
XLM-RoBERTa head (classifier.dense, classifier.out_proj) keeps both, which is BERT's
pooler and classifier in our model (runtime/models/bert.py), so its scores are the
transformers model's. A BertForSequenceClassification loses its pooler in the converter
(it is dropped as an embedding model's unused one), leaving `cls.output` alone: llama.cpp
then scores the [CLS] state without the pooler's dense and tanh, which is not the model
any more, so such a file is refused with the way out (its HF folder).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import processors

from runtime.load.gguf.quants import dequantize
from runtime.load.gguf.reader import GGUFFile
from runtime.load.gguf.tokenizer import tokenizer_from_gguf
from runtime.models import Pooling, PoolingMode
from runtime.text import Tokenizer

ENCODER_ARCHITECTURES = frozenset({"bert"})
# llama.cpp's enum llama_pooling_type
_POOLING = {1: PoolingMode.MEAN, 2: PoolingMode.CLS, 3: PoolingMode.LAST}
_POOLING_NAMES = {0: "none", 4: "rank"}
_RANK = 4
_LABELS_KEY = "classifier.output_labels"
_TOP = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_LAYER = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
# a cross-encoder's head, as runtime/models/bert.py's BertHead reads it
_HEAD = {"cls": "pooler.dense", "cls.output": "classifier"}
_STRING = 8  # GGUF's metadata value type for a string


@dataclass(frozen=True)
class GGUFEncoder:
    config: dict[str, Any]  # as config.json would have it
    weights: dict[str, np.ndarray]  # transformers' names, float32
    tokenizer: Tokenizer
    pooling: Pooling | None  # None: a cross-encoder (config's num_labels outputs)


def gguf_architecture(path: Path) -> str | None:
    """`general.architecture` read from the head of a GGUF file (the converter writes it
    first; the whole metadata of a chat model takes seconds to parse); None when the file
    is no GGUF or the key is not among the first plain values."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    if head[:4] != b"GGUF" or len(head) < 24:
        return None
    at, count = 24, struct.unpack_from("<Q", head, 16)[0]
    for _ in range(min(count, 8)):
        try:
            (size,) = struct.unpack_from("<Q", head, at)
            key = head[at + 8 : at + 8 + size].decode("utf-8")
            (kind,) = struct.unpack_from("<I", head, at + 8 + size)
            at += 12 + size
            if kind != _STRING:
                return None  # a value this peek does not step over: parse the file
            (length,) = struct.unpack_from("<Q", head, at)
            value = head[at + 8 : at + 8 + length].decode("utf-8")
            at += 8 + length
        except (struct.error, UnicodeDecodeError):
            return None
        if key == "general.architecture":
            return value
    return None


def is_gguf_encoder(path: Path) -> bool:
    if not path.is_file():
        return False
    arch = gguf_architecture(path)
    if arch is None and path.suffix.lower() == ".gguf":
        try:
            arch = GGUFFile(path).architecture
        except ValueError:
            return False
    return arch in ENCODER_ARCHITECTURES


def read_gguf_encoder(path: Path) -> GGUFEncoder:
    """The parts of a GGUF embedding model or cross-encoder (see the module docstring)."""
    gf = GGUFFile(path)
    if gf.architecture not in ENCODER_ARCHITECTURES:
        raise ValueError(f"{path}: a {gf.architecture!r} GGUF is not an encoder")
    kind = int(gf.arch_get("pooling_type", 1))
    scores = _scores(gf)
    if not scores and kind not in _POOLING:
        name = _POOLING_NAMES.get(kind, str(kind))
        raise ValueError(
            f"{path}: pooling type {name!r} is not served from GGUF (mean, CLS, last token "
            "and a cross-encoder's rank are); serve the model's HF folder instead"
        )
    weights = _weights(gf, int(gf.arch_get("block_count")))
    config = _config(gf, weights)
    tokenizer = _tokenizer(gf)
    if scores:
        config.update(_head(path, gf, weights))
        return GGUFEncoder(config, weights, tokenizer, None)
    return GGUFEncoder(config, weights, tokenizer, Pooling((_POOLING[kind],), normalize=True))


def gguf_encoder_scores(path: Path) -> bool:
    """Whether a BERT-family GGUF is a cross-encoder (reads the metadata, not weights)."""
    return _scores(GGUFFile(path))


def _scores(gf: GGUFFile) -> bool:
    labelled = gf.arch_get(_LABELS_KEY) is not None
    return (
        int(gf.arch_get("pooling_type", 1)) == _RANK
        or labelled
        or "cls.output.weight" in gf.tensors
    )


def _tokenizer(gf: GGUFFile) -> Tokenizer:
    """The file's tokenizer. A byte-level BPE one is a RoBERTa's (the WordPiece one brings
    [CLS] and [SEP] itself): its inputs are framed as llama.cpp frames them, <s> text </s>
    and a pair <s> query </s></s> document </s> (bos, eos, then sep = eos), all of token
    type 0, which is RoBERTa's own template."""
    tokenizer = tokenizer_from_gguf(gf)
    bos, eos = gf.get("tokenizer.ggml.bos_token_id"), gf.get("tokenizer.ggml.eos_token_id")
    if gf.get("tokenizer.ggml.model") == "gpt2" and bos is not None and eos is not None:
        tokens = gf.get("tokenizer.ggml.tokens")
        tokenizer.hf.post_processor = processors.RobertaProcessing(
            (str(tokens[int(eos)]), int(eos)), (str(tokens[int(bos)]), int(bos)),
            trim_offsets=False, add_prefix_space=False,
        )  # fmt: skip
    return tokenizer


def _head(path: Path, gf: GGUFFile, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """A cross-encoder's config keys; refused where the file cannot give its scores."""
    if "classifier.weight" not in weights:
        raise ValueError(
            f"{path}: pooling type 'rank' scores with a classification head (cls.output), "
            "and this file has none"
        )
    if "pooler.dense.weight" not in weights:
        raise ValueError(
            f"{path}: this cross-encoder's head is its classifier alone (cls.output without "
            "cls): llama.cpp's converter leaves out a BertForSequenceClassification's pooler "
            "(the dense layer and tanh its classifier reads), so no server can give the "
            "model's scores from this file; serve the model's HF folder instead"
        )
    labels = int(weights["classifier.weight"].shape[0])
    names = gf.arch_get(_LABELS_KEY)
    if isinstance(names, list) and names and len(names) != labels:
        raise ValueError(f"{path}: {len(names)} labels named for a head of {labels} outputs")
    return {"architectures": ["BertForSequenceClassification"], "num_labels": labels}


def _config(gf: GGUFFile, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    types = weights["embeddings.token_type_embeddings.weight"].shape[0]
    return {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": weights["embeddings.word_embeddings.weight"].shape[0],
        "hidden_size": int(gf.arch_get("embedding_length")),
        "num_hidden_layers": int(gf.arch_get("block_count")),
        "num_attention_heads": int(gf.arch_get("attention.head_count")),
        "intermediate_size": int(gf.arch_get("feed_forward_length")),
        "max_position_embeddings": weights["embeddings.position_embeddings.weight"].shape[0],
        "type_vocab_size": types,
        "layer_norm_eps": float(gf.arch_get("attention.layer_norm_epsilon", 1e-12)),
        "hidden_act": "gelu",  # BERT's exact GELU, as transformers runs it
        "pad_token_id": int(gf.get("tokenizer.ggml.padding_token_id", 0)),
    }


def _weights(gf: GGUFFile, layers: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, info in gf.tensors.items():
        ours = _hf_name(name, layers)
        if ours is None:
            raise ValueError(f"{gf.path}: tensor {name!r} is not a BERT weight read here")
        out[ours] = dequantize(gf.raw(name), info.ggml_type, info.shape)
    return out


def _hf_name(name: str, layers: int) -> str | None:
    stem, dot, part = name.rpartition(".")
    if not dot or part not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.{part}"
    if stem in _HEAD:
        return f"{_HEAD[stem]}.{part}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    index, rest = parts[1], parts[2]
    if int(index) >= layers or rest not in _LAYER:
        return None
    return f"encoder.layer.{index}.{_LAYER[rest]}.{part}"
