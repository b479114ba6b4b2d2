"""Streaming detokenization: token ids in, complete characters out, O(1) amortised per token.

The concatenated output of a ``StreamingDetokenizer`` equals
``tokenizer.decode(ids, skip_special_tokens=True)`` (with ``skip_ids`` the special tokens).
That decode runs every kept token through the decoder chain as one list (added tokens
included), so:

- ByteLevel (GPT-2 style): each token is a byte string; the whole output is UTF-8 decoded
  lossily. We keep an incremental UTF-8 decoder that holds back an unfinished sequence.
- SentencePiece style (``Replace`` ▁ -> space, ``ByteFallback``, ``Fuse``, ``Strip``): a run of
  ``<0xNN>`` tokens is decoded on its own when the run ends, and becomes one U+FFFD per byte
  if it is not valid UTF-8, so a run is held back whole. ``Strip`` cuts leading (and
  trailing) content characters of the fused text: only the start of the generation.
- Anything else: decode a small window of recent ids and emit the stable difference.

``DetokenizerTable.build`` reads the vocabulary once per model; each request makes a cheap
``StreamingDetokenizer`` from it.
"""

from __future__ import annotations

import codecs
import enum
import json
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"
# The incremental fallback gives up waiting for a character to complete after this many
# tokens: by then the text really holds invalid bytes.
_MAX_PENDING_TOKENS = 16


class DecoderKind(enum.Enum):
    BYTE_LEVEL = "byte_level"
    SENTENCEPIECE = "sentencepiece"
    INCREMENTAL = "incremental"


@dataclass(frozen=True)
class StripRule:
    """The ``Strip`` decoder applied to the fused text: drop up to ``start`` leading and
    ``stop`` trailing ``content`` characters."""

    content: str = " "
    start: int = 0
    stop: int = 0


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Invert GPT-2's bytes -> printable-unicode map: printable Latin-1 bytes stand for
    themselves, the rest were shifted to code points 256 and up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _byte_level_piece(token: str, char_to_byte: Mapping[str, int]) -> bytes:
    # Like tokenizers' ByteLevel decoder: a token with any unmapped character (an added
    # token such as "<|im_start|> x") is taken as its literal UTF-8.
    out = bytearray()
    for ch in token:
        b = char_to_byte.get(ch)
        if b is None:
            return token.encode("utf-8")
        out.append(b)
    return bytes(out)


def _byte_fallback_value(token: str) -> int | None:
    """``<0xNN>`` -> NN, as the ByteFallback decoder recognises it."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        digits = token[3:5]
        if all(c in string.hexdigits for c in digits):
            return int(digits, 16)
    return None


@dataclass(frozen=True)
class _SentencePieceSpec:
    replacements: tuple[tuple[str, str], ...]
    byte_fallback: bool
    strip: StripRule


def _decoder_steps(decoder: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return list(decoder.get("decoders", []))
    return [decoder]


def _parse_sentencepiece(steps: list[Mapping[str, Any]]) -> _SentencePieceSpec | None:
    """Accept the shape ``Replace* ByteFallback? Fuse? Strip?`` (Strip only after Fuse, where it
    sees the whole text); anything else goes to the incremental fallback."""
    i = 0
    replacements: list[tuple[str, str]] = []
    while i < len(steps) and steps[i].get("type") == "Replace":
        pattern = steps[i].get("pattern", {})
        if "String" not in pattern:
            return None
        replacements.append((str(pattern["String"]), str(steps[i].get("content", ""))))
        i += 1
    byte_fallback = i < len(steps) and steps[i].get("type") == "ByteFallback"
    i += byte_fallback
    fused = i < len(steps) and steps[i].get("type") == "Fuse"
    i += fused
    strip = StripRule()
    if fused and i < len(steps) and steps[i].get("type") == "Strip":
        s = steps[i]
        strip = StripRule(str(s.get("content", " ")), int(s.get("start", 0)), int(s.get("stop", 0)))
        i += 1
    if i != len(steps) or not (replacements or byte_fallback):
        return None
    return _SentencePieceSpec(tuple(replacements), byte_fallback, strip)


def _id_to_token_list(tokenizer: Tokenizer) -> list[str | None]:
    size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    return [tokenizer.id_to_token(i) for i in range(size)]


def special_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the added tokens marked special: what ``skip_special_tokens=True`` hides."""
    return frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)


@dataclass(frozen=True, eq=False)
class DetokenizerTable:
    """Per-model decoding data, built once (``build``) and shared by every request."""

    kind: DecoderKind
    tokenizer: Tokenizer
    skip_ids: frozenset[int]
    byte_pieces: tuple[bytes, ...] = ()  # BYTE_LEVEL: id -> bytes
    sp_pieces: tuple[str | int, ...] = ()  # SENTENCEPIECE: id -> text, or a fallback byte
    strip: StripRule = field(default_factory=StripRule)

    @classmethod
    def build(cls, tokenizer: Tokenizer, skip_ids: Iterable[int] = ()) -> DetokenizerTable:
        skip = frozenset(skip_ids)
        config = json.loads(tokenizer.to_str()).get("decoder")
        steps = _decoder_steps(config)
        if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
            char_to_byte = _gpt2_unicode_to_byte()
            pieces = tuple(
                b"" if tok is None else _byte_level_piece(tok, char_to_byte)
                for tok in _id_to_token_list(tokenizer)
            )
            return cls(DecoderKind.BYTE_LEVEL, tokenizer, skip, byte_pieces=pieces)
        spec = _parse_sentencepiece(steps)
        if spec is not None:
            return cls(
                DecoderKind.SENTENCEPIECE,
                tokenizer,
                skip,
                sp_pieces=_sentencepiece_pieces(tokenizer, spec),
                strip=spec.strip,
            )
        return cls(DecoderKind.INCREMENTAL, tokenizer, skip)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (for logprob ``bytes`` fields); no stripping, no skipping."""
        if self.kind is DecoderKind.BYTE_LEVEL:
            return self.byte_pieces[token_id] if 0 <= token_id < len(self.byte_pieces) else b""
        if self.kind is DecoderKind.SENTENCEPIECE:
            if not 0 <= token_id < len(self.sp_pieces):
                return b""
            piece = self.sp_pieces[token_id]
            return bytes([piece]) if isinstance(piece, int) else piece.encode("utf-8")
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """The token's own text; a partial UTF-8 sequence shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _sentencepiece_pieces(tokenizer: Tokenizer, spec: _SentencePieceSpec) -> tuple[str | int, ...]:
    pieces: list[str | int] = []
    for tok in _id_to_token_list(tokenizer):
        if tok is None:
            pieces.append("")
            continue
        for pattern, content in spec.replacements:
            tok = tok.replace(pattern, content)
        value = _byte_fallback_value(tok) if spec.byte_fallback else None
        pieces.append(tok if value is None else value)
    return tuple(pieces)


# the bytes that may follow each UTF-8 lead byte as its second (RFC 3629: no overlong
# forms, no surrogates, nothing above U+10FFFF)
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _may_continue(held: bytes) -> bool:
    """Whether held bytes (a lead byte and continuations) can still become a character."""
    low, high = _SECOND_BYTE.get(held[0], (0x80, 0xBF))
    return low <= held[1] <= high


class StreamingDetokenizer:
    """One request's detokenizer: ``add`` returns newly completed text, ``flush`` the rest."""

    def __init__(self, table: DetokenizerTable) -> None:
        self.table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._run = bytearray()  # SentencePiece: pending <0xNN> bytes
        self._strip_left = table.strip.start
        self._tail = ""  # SentencePiece: trailing strip characters held back
        self._window: list[int] = []  # incremental fallback
        self._prefix = 0
        self._read = 0

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, skip_ids: Iterable[int] = ()
    ) -> StreamingDetokenizer:
        """One-off convenience; servers should build the table once per model."""
        return cls(DetokenizerTable.build(tokenizer, skip_ids))

    def add(self, token_id: int) -> str:
        table = self.table
        if token_id in table.skip_ids:
            return ""
        if table.kind is DecoderKind.BYTE_LEVEL:
            if not 0 <= token_id < len(table.byte_pieces):
                return ""  # decode ignores unknown ids (e.g. padded model vocab)
            text = self._utf8.decode(table.byte_pieces[token_id])
            held = self._utf8.getstate()[0]
            if len(held) >= 2 and not _may_continue(held):
                # CPython's incremental decoder holds a lead byte and a continuation it
                # cannot follow (e.g. ED A1, a surrogate) until the end; decode says
                # U+FFFD for each byte at once, and so do we
                text += self._utf8.decode(b"", final=True)
                self._utf8.reset()
            return text
        if table.kind is DecoderKind.SENTENCEPIECE:
            if not 0 <= token_id < len(table.sp_pieces):
                return ""
            piece = table.sp_pieces[token_id]
            if isinstance(piece, int):
                self._run.append(piece)
                return ""
            return self._emit(self._resolve_run() + piece)
        return self._add_incremental(token_id)

    def flush(self) -> str:
        kind = self.table.kind
        if kind is DecoderKind.BYTE_LEVEL:
            return self._utf8.decode(b"", final=True)
        if kind is DecoderKind.SENTENCEPIECE:
            out = self._emit(self._resolve_run())
            self._tail = ""  # trailing strip characters at the very end are cut
            return out
        return self._flush_incremental()

    # -- SentencePiece ------------------------------------------------------------------------

    def _resolve_run(self) -> str:
        """ByteFallback decodes a finished run as a whole: valid UTF-8, or one U+FFFD a byte."""
        if not self._run:
            return ""
        try:
            text = self._run.decode("utf-8")
        except UnicodeDecodeError:
            text = _REPLACEMENT * len(self._run)
        self._run.clear()
        return text

    def _emit(self, text: str) -> str:
        strip = self.table.strip
        if self._strip_left and text:
            cut = 0
            while cut < len(text) and cut < self._strip_left and text[cut] == strip.content:
                cut += 1
            # Once any other character has gone by, the start of the text is settled.
            self._strip_left = 0 if cut < len(text) else self._strip_left - cut
            text = text[cut:]
        if not strip.stop:
            return text
        text = self._tail + text
        held = 0
        while held < strip.stop and held < len(text) and text[-1 - held] == strip.content:
            held += 1
        self._tail = text[len(text) - held :]
        return text[: len(text) - held]

    # -- incremental fallback -----------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.table.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def _add_incremental(self, token_id: int) -> str:
        self._window.append(token_id)
        prefix_text = self._decode(self._window[self._prefix : self._read])
        new_text = self._decode(self._window[self._prefix :])
        pending = len(self._window) - self._read
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(_REPLACEMENT) and pending < _MAX_PENDING_TOKENS
        ):
            return ""
        # Keep the last emitted stretch as left context so spacing rules see a real neighbour.
        del self._window[: self._read]
        self._prefix, self._read = 0, len(self._window)
        return new_text[len(prefix_text) :]

    def _flush_incremental(self) -> str:
        prefix_text = self._decode(self._window[self._prefix : self._read])
        new_text = self._decode(self._window[self._prefix :])
        self._window.clear()
        self._prefix = self._read = 0
        return new_text[len(prefix_text) :]
