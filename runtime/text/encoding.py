"""Encoder inputs from text: a tokenizer's ids with its special tokens ([CLS] ... [SEP],
<s> ... </s>) added by its own post-processor, measured against a limit and truncated
as transformers' tokenizers truncate (the end of a text is dropped; a pair loses tokens
from its longer side first, `longest_first`), so the result is the ids
sentence-transformers feeds its model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Encoding

from runtime.text.tokenizer import Tokenizer
from runtime.types import EncodeInput


@dataclass(frozen=True)
class TextTokens:
    """One text's input, and how many tokens it had before any truncation."""

    input: EncodeInput
    full_length: int

    @property
    def truncated(self) -> bool:
        return self.full_length > len(self.input.tokens)


class EncoderTokenizer:
    """A tokenizer as an encoder uses it (`lowercase`: sentence-transformers'
    do_lower_case)."""

    def __init__(self, tokenizer: Tokenizer, *, lowercase: bool = False) -> None:
        self.tokenizer = tokenizer
        self._hf = tokenizer.hf
        self._lowercase = lowercase
        processor = self._hf.post_processor
        self.single_specials = (
            0 if processor is None else processor.num_special_tokens_to_add(False)
        )
        self.pair_specials = 0 if processor is None else processor.num_special_tokens_to_add(True)

    def _texts(self, texts: Sequence[str]) -> list[Encoding]:
        batch = [t.lower() for t in texts] if self._lowercase else list(texts)
        encodings: list[Encoding] = self._hf.encode_batch(batch, add_special_tokens=False)
        return encodings

    def texts(self, texts: Sequence[str], limit: int | None = None) -> list[TextTokens]:
        """Each text's ids with special tokens, cut to `limit` tokens when longer."""
        out = []
        for enc in self._texts(texts):
            full = len(enc.ids) + self.single_specials
            if limit is not None and full > limit:
                enc.truncate(max(0, limit - self.single_specials))
            done = self._hf.post_process(enc, None, True)
            out.append(TextTokens(EncodeInput(tuple(done.ids)), full))
        return out

    def pairs(
        self, query: str, documents: Sequence[str], limit: int, document_limit: int | None = None
    ) -> list[TextTokens]:
        """(query, document) pairs as one input each, cut to `limit` tokens longest side
        first; `document_limit` cuts each document's own tokens first."""
        budget = max(0, limit - self.pair_specials)
        docs = self._texts(documents)
        out = []
        for doc in docs:
            if document_limit is not None and len(doc.ids) > document_limit:
                doc.truncate(document_limit)
            first = self._texts([query])[0]  # truncate() changes an encoding in place
            full = len(first.ids) + len(doc.ids) + self.pair_specials
            keep_first, keep_second = longest_first(len(first.ids), len(doc.ids), budget)
            first.truncate(keep_first)
            doc.truncate(keep_second)
            done = self._hf.post_process(first, doc, True)
            types = done.type_ids
            second = next((i for i, t in enumerate(types) if t == 1), None)
            out.append(TextTokens(EncodeInput(tuple(done.ids), second), full))
        return out


def longest_first(first: int, second: int, budget: int) -> tuple[int, int]:
    """The tokens each side of a pair keeps under `budget` (the tokenizers library's
    LongestFirst: the longer side is cut down to the shorter; if both are still too
    long, they split the budget)."""
    if first + second <= budget:
        return first, second
    short, long = sorted((first, second))
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short = budget // 2
        long = short + budget % 2
    return (short, long) if first <= second else (long, short)
