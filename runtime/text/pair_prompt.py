"""(query, document) pairs written into a prompt, for a reranker that reads a pair as one
text rather than as two token-type segments (a decoder: Qwen3-Reranker).

A pair becomes `prefix` + `body` + `suffix` in tokens: the prefix and suffix are
tokenized on their own, the body (`template` with the query and the document filled in)
as one text, so its tokens are those of the whole formatted string. A body too long
for the limit loses its end (the document's end), as the model card's code truncates it;
`document_limit` first cuts the document to its first that many tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.text.encoding import TextTokens
from runtime.text.tokenizer import Tokenizer
from runtime.types import EncodeInput


@dataclass(frozen=True)
class PairPrompt:
    prefix: str
    template: str  # with {query} and {document}
    suffix: str

    def pairs(
        self,
        tokenizer: Tokenizer,
        query: str,
        documents: Sequence[str],
        limit: int,
        document_limit: int | None = None,
    ) -> list[TextTokens]:
        """One input per document, at most `limit` tokens each (see the module docstring)."""
        hf = tokenizer.hf
        head = hf.encode(self.prefix, add_special_tokens=False).ids
        tail = hf.encode(self.suffix, add_special_tokens=False).ids
        budget = limit - len(head) - len(tail)
        if budget < 1:
            raise ValueError(f"the reranker's prompt alone is over its {limit}-token limit")
        if document_limit is not None:
            documents = [_first_tokens(tokenizer, d, document_limit) for d in documents]
        bodies = [self.template.format(query=query, document=d) for d in documents]
        out = []
        for enc in hf.encode_batch(bodies, add_special_tokens=False):
            ids = enc.ids
            full = len(head) + len(ids) + len(tail)
            out.append(TextTokens(EncodeInput((*head, *ids[:budget], *tail)), full))
        return out


def _first_tokens(tokenizer: Tokenizer, text: str, count: int) -> str:
    """`text` cut after its first `count` tokens (whole when shorter)."""
    enc = tokenizer.hf.encode(text, add_special_tokens=False)
    if len(enc.ids) <= count:
        return text
    return text[: enc.offsets[count - 1][1]] if count > 0 else ""
