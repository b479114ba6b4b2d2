"""Our tokenizer (runtime.text.Tokenizer) from a GGUF file's ``tokenizer.ggml.*`` metadata.

The format is known here, in the loader, so that runtime/text knows no file format.
Two vocabulary kinds matter (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE. Tokens are already spelled in the GPT-2 byte alphabet and
  the merges are given; what the file does not say is how text is split before BPE, so
  the split is chosen by ``tokenizer.ggml.pre`` (llama.cpp's names;
  runtime/load/gguf/pretokenizers.py).
- ``llama``: SentencePiece BPE (Llama 2, Mistral, Gemma). The file has tokens and
  scores but no merges; SentencePiece merges the adjacent pair whose joined piece ranks
  best, so merges are derived as "every split of a piece into two pieces", ranked by the
  joined piece. Gemma's scores do not follow its merge order while its token order does,
  so Gemma ranks by position and the others by score. Spaces are written ``▁``; byte
  tokens ``<0xNN>`` back the BPE up (byte fallback).
- ``bert``: WordPiece (BERT-family encoders). llama.cpp's converter respells the
  vocabulary: a word-initial piece gets a leading ``▁`` and a continuation piece loses its
  ``##``; both are undone here, and the file's [CLS] (BOS) and [SEP] frame each input
  (``[CLS] A [SEP] B [SEP]`` for a pair), as BERT's own tokenizer does.

Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte. Control tokens become special added tokens (matched whole, hidden on decode);
user-defined ones become plain added tokens (matched whole, shown).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from runtime.load.gguf.pretokenizers import pre_tokenizer
from runtime.load.gguf.reader import GGUFFile
from runtime.text import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Architectures whose SentencePiece vocabularies rank merges by token order, not score.
_RANK_BY_POSITION = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})


def _token(tokens: Sequence[str], index: Any) -> str | None:
    if index is None:
        return None
    i = int(index)
    return tokens[i] if 0 <= i < len(tokens) else None


def _types(meta: Mapping[str, Any], n: int) -> np.ndarray:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return np.full(n, NORMAL, dtype=np.int32)
    return np.asarray(types, dtype=np.int32)


def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id, keeping the first id of a repeated token."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(meta: Mapping[str, Any], tokens: list[str], types: np.ndarray) -> HFTokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    spelled = list(tokens)
    for i, text in enumerate(tokens):
        # A normal token outside the byte alphabet is raw text: respell its UTF-8 bytes.
        if types[i] == NORMAL and not set(text) <= letters:
            spelled[i] = "".join(alphabet[b] for b in text.encode("utf-8"))
    merges_raw = meta.get("tokenizer.ggml.merges") or []
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    pre = pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    model = models.BPE(
        vocab=_first_ids(spelled),
        merges=merges,
        ignore_merges=pre.ignore_merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = HFTokenizer(model)
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.build()
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(
    tokens: list[str], types: np.ndarray, scores: np.ndarray | None, by_position: bool
) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best-ranked piece first."""
    normal = {tok: i for i, tok in enumerate(tokens) if types[i] == NORMAL}
    if by_position or scores is None:
        order = sorted(normal.values())
    else:
        # stable: equal scores keep token order
        order = sorted(normal.values(), key=lambda i: -float(scores[i]))
    merges: list[tuple[str, str]] = []
    for i in order:
        piece = tokens[i]
        pairs = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in normal and piece[k:] in normal
        ]
        if len(pairs) > 1:
            pairs.sort(key=lambda p: (normal[p[0]], normal[p[1]]))
        merges.extend(pairs)
    return merges


def _sentencepiece(
    meta: Mapping[str, Any], tokens: list[str], types: np.ndarray, arch: str
) -> HFTokenizer:
    # Some converters store pieces made only of spaces with real spaces; BPE sees "▁".
    spelled = [
        "▁" * len(t) if t and not t.strip(" ") and types[i] == NORMAL else t
        for i, t in enumerate(tokens)
    ]
    scores_raw = meta.get("tokenizer.ggml.scores")
    scores = None if scores_raw is None else np.asarray(scores_raw, dtype=np.float32)
    merges = _spm_merges(spelled, types, scores, arch in _RANK_BY_POSITION)
    unk = _token(spelled, meta.get("tokenizer.ggml.unknown_token_id"))
    model = models.BPE(
        vocab=_first_ids(spelled),
        merges=merges,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(model)
    # llama.cpp's default: SentencePiece vocabularies add a leading space unless told not to.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[decoders.Decoder] = [
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if prefix:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(steps)
    return tok


def _wordpiece(meta: Mapping[str, Any], tokens: list[str], types: np.ndarray) -> HFTokenizer:
    spelled = [
        t if types[i] != NORMAL else t[1:] if t.startswith("▁") else f"##{t}"
        for i, t in enumerate(tokens)
    ]
    unk = _token(spelled, meta.get("tokenizer.ggml.unknown_token_id")) or "[UNK]"
    tok = HFTokenizer(models.WordPiece(_first_ids(spelled), unk_token=unk))
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls = _token(spelled, meta.get("tokenizer.ggml.bos_token_id"))
    sep_id = meta.get("tokenizer.ggml.seperator_token_id", meta.get("tokenizer.ggml.eos_token_id"))
    sep = _token(spelled, sep_id)
    if cls is None or sep is None:
        raise ValueError("a GGUF WordPiece vocabulary needs its [CLS] (bos) and [SEP] ids")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, spelled.index(cls)), (sep, spelled.index(sep))],
    )
    return tok


def _add_whole_tokens(tok: HFTokenizer, tokens: list[str], types: np.ndarray) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens."""
    control = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.nonzero(types == CONTROL)[0]
        if tokens[i]
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in np.nonzero(types == USER_DEFINED)[0]
        if tokens[i]
    ]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def build_hf_tokenizer(meta: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer a GGUF's metadata describes (see the module docstring)."""
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("the GGUF has no tokenizer (no tokenizer.ggml.tokens in its metadata)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = _types(meta, len(tokens))
    kind = str(meta.get("tokenizer.ggml.model", "gpt2"))
    arch = str(meta.get("general.architecture", ""))
    if kind == "gpt2":
        tok = _byte_level(meta, tokens, types)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens, types, arch)
    elif kind == "bert":
        tok = _wordpiece(meta, tokens, types)
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama, bert)"
        )
    _add_whole_tokens(tok, tokens, types)
    return tok


def _eos_ids(meta: Mapping[str, Any], n_tokens: int) -> frozenset[int]:
    """The end-of-sequence id plus llama.cpp's end-of-turn / end-of-message ids."""
    ids = set()
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < n_tokens:
            ids.add(int(value))
    return frozenset(ids)


def tokenizer_from_gguf(source: GGUFFile | Mapping[str, Any] | str | Path) -> Tokenizer:
    """Our tokenizer from a GGUF: a path, a parsed :class:`GGUFFile` (parse it once and
    share it: the metadata is large), or its metadata mapping."""
    if isinstance(source, (str, Path)):
        source = GGUFFile(source)
    meta: Mapping[str, Any] = source.metadata if isinstance(source, GGUFFile) else source
    hf = build_hf_tokenizer(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    kind = str(meta.get("tokenizer.ggml.model", "gpt2"))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # llama.cpp adds BOS for SentencePiece vocabularies that do not say otherwise.
        add_bos = kind == "llama"
    return Tokenizer(
        hf,
        bos_token=_token(tokens, meta.get("tokenizer.ggml.bos_token_id")),
        eos_token=_token(tokens, meta.get("tokenizer.ggml.eos_token_id")),
        add_bos=bool(add_bos),
        extra_eos_ids=_eos_ids(meta, len(tokens)),
    )
