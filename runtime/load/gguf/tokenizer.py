"""Build a ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two vocabulary kinds matter (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE. Tokens are already spelled in the GPT-2 byte alphabet and
  the merges are given; what the file does not say is how text is split before BPE, so
  the split is chosen by ``tokenizer.ggml.pre`` (llama.cpp's names) and mirrors the
  original ``tokenizer.json`` of that family: one or several regex splits, maybe a
  one-digit-per-piece split, then the byte alphabet (Qwen2 also normalizes to NFC).
  An unknown name is refused, as llama.cpp does: another split gives other ids.
- ``llama``: SentencePiece BPE (Llama 2, Mistral, Gemma). The file has tokens and
  scores but no merges; SentencePiece merges the adjacent pair whose joined piece ranks
  best, so merges are derived as "every split of a piece into two pieces", ranked by the
  joined piece. Gemma's scores do not follow its merge order while its token order does,
  so Gemma ranks by position and the others by score. Spaces are written ``▁``; byte
  tokens ``<0xNN>`` back the BPE up (byte fallback).

Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte. Control tokens become special added tokens (matched whole, hidden on decode);
user-defined ones become plain added tokens (matched whole, shown).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the byte-level families, as in their tokenizer.json files.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _char_class(spec: str) -> str:
    """A regex character-class body from hex code points and ranges ("0041-005A 00B5").

    Written as code points because several of these characters have look-alikes that
    editors and NFC normalization swap in (U+212A KELVIN SIGN becomes "K", turning
    "K-ℭ" into a range over most of the BMP)."""
    out = []
    for item in spec.split():
        low, _, high = item.partition("-")
        out.append(chr(int(low, 16)) + (f"-{chr(int(high, 16))}" if high else ""))
    return "".join(out)


# DeepSeek LLM / V2: the cased letters (Lu, Ll, Lt) as their tokenizer.json lists them.
_DEEPSEEK_LETTERS = _char_class(
    "0041-005A 0061-007A 00B5 00C0-00D6 00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF "
    "0370-0373 0376 0377 037B-037D 037F 0386 0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 "
    "048A-052F 0531-0556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B "
    "1D6B-1D77 1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D "
    "1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC "
    "1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128 212A-212D "
    "212F-2134 2139 213C-213F 2145-2149 214E 2183 2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2 "
    "2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 "
    "FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 "
    "118A0-118DF 1E900-1E943"
)
# ASCII and full-width punctuation, curly quotes, ideographic space and full stop.
_DEEPSEEK_PUNCT = _char_class("0021-002F 003A-007E FF01-FF0F FF1A-FF5E 2018-201F 3000-3002")
# CJK ideographs, everything from U+0800 up to them, and Hangul syllables.
_DEEPSEEK_CJK = _char_class("4E00-9FA5 0800-4E00 AC00-D7FF")
# DeepSeek-V3: CJK ideographs, Hiragana, Katakana.
_DEEPSEEK_V3_CJK = _char_class("4E00-9FA5 3040-309F 30A0-30FF")
_DEEPSEEK_V3_SPLIT = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Kimi-K2 (tiktoken, tokenization_kimi.py): gpt-4o's letter runs, but runs of Han
# ideographs stand alone: `&&` is class intersection (Oniguruma has it, as tiktoken's
# regex engine does).
_KIMI_K2_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2_SPLIT = (
    r"[\p{Han}]+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_K2_UPPER}*{_KIMI_K2_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_K2_UPPER}+{_KIMI_K2_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How one family splits text before BPE, in this order: each regex of ``splits``
    isolates its matches in every piece so far; then, with ``individual_digits``, every
    digit becomes its own piece; then the byte alphabet (with GPT-2's own regex when
    ``splits`` is empty)."""

    splits: tuple[str, ...] = ()
    individual_digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False  # whole pre-token in vocab wins (tiktoken-style vocabularies)


_QWEN2 = _PreTokenizer(splits=(_QWEN2_SPLIT,), nfc=True)
_LLAMA3 = _PreTokenizer(splits=(_LLAMA3_SPLIT,), ignore_merges=True)
_GPT4O = _PreTokenizer(splits=(_GPT4O_SPLIT,))
_STARCODER = _PreTokenizer(individual_digits=True)
_GPT2 = _PreTokenizer()
_DEEPSEEK_LLM = _PreTokenizer(
    splits=(
        r"[\r\n]",
        rf"\s?[{_DEEPSEEK_LETTERS}]+",
        rf"\s?[{_DEEPSEEK_PUNCT}]+",
        r"\s+$",
        f"[{_DEEPSEEK_CJK}]+",
    ),
    individual_digits=True,
)
_DEEPSEEK_CODER = _PreTokenizer(
    splits=(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", f"[{_DEEPSEEK_CJK}]+"),
    individual_digits=True,
)
_DEEPSEEK_V3 = _PreTokenizer(splits=(r"\p{N}{1,3}", f"[{_DEEPSEEK_V3_CJK}]+", _DEEPSEEK_V3_SPLIT))
# GLM-4's tokenizer is tiktoken with cl100k's pattern: Llama 3's split, whole pieces first.
_GLM4 = _LLAMA3
# Kimi-K2's tokenizer is tiktoken too: whole pieces first.
_KIMI_K2 = _PreTokenizer(splits=(_KIMI_K2_SPLIT,), ignore_merges=True)

# tokenizer.ggml.pre -> how that family splits text
_PRE_TOKENIZERS: Mapping[str, _PreTokenizer] = {
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "dbrx": _LLAMA3,
    "gpt-4o": _GPT4O,
    "llama4": _GPT4O,
    # DeepSeek LLM and V2 / V2.5 (one 100k vocabulary), DeepSeek Coder, DeepSeek V3 / R1.
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "deepseek-v3": _DEEPSEEK_V3,
    "glm4": _GLM4,
    "chatglm-bpe": _GLM4,
    # Kimi-K2 (arch deepseek2, its own tiktoken vocabulary).
    "kimi-k2": _KIMI_K2,
    # StarCoder-derived vocabularies (SmolLM, StarCoder, Refact) split every digit.
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
}

# Architectures whose SentencePiece vocabularies rank merges by token order, not score.
_RANK_BY_POSITION = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """What the metadata says beyond the vocabulary itself."""

    tokenizer: HFTokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    eos_token_ids: frozenset[int]
    chat_template: str | None


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


def _pre_tokenizer(pre: _PreTokenizer) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False)
        for split in pre.splits
    ]
    if pre.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(
        pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=False, use_regex=not pre.splits
        )
    )
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


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
    pre_name = str(meta.get("tokenizer.ggml.pre", "default"))
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        # As llama.cpp does: another split gives other token ids, i.e. a wrong model.
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {pre_name!r} is not known here (known: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}): this file needs a newer mlx-gateway, "
            "or serve the model from a folder with its tokenizer.json"
        )
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
    tok.pre_tokenizer = _pre_tokenizer(pre)
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
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
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


def read_gguf_tokenizer(meta: Mapping[str, Any]) -> GGUFTokenizerInfo:
    """The tokenizer and its special-token facts from GGUF metadata."""
    hf = build_hf_tokenizer(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    kind = str(meta.get("tokenizer.ggml.model", "gpt2"))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # llama.cpp adds BOS for SentencePiece vocabularies that do not say otherwise.
        add_bos = kind == "llama"
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizerInfo(
        tokenizer=hf,
        bos_token=_token(tokens, meta.get("tokenizer.ggml.bos_token_id")),
        eos_token=_token(tokens, meta.get("tokenizer.ggml.eos_token_id")),
        add_bos=bool(add_bos),
        eos_token_ids=_eos_ids(meta, len(tokens)),
        chat_template=str(template) if template else None,
    )
