"""A rerank request checked and turned into encoder inputs: each (query, document) pair
tokenized as one cross-encoder input, truncated longest side first to the model's limit
as sentence-transformers' CrossEncoder does (a long document is cut, never refused)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.errors import InvalidRequest
from gateway.rerank.wire import RerankRequest
from runtime.load import LoadedEncoder
from runtime.text import EncoderTokenizer
from runtime.types import EncodeInput

MAX_DOCUMENTS = 2048


@dataclass(frozen=True)
class RerankPlan:
    query: str
    documents: tuple[str, ...]
    top_n: int  # results returned, best first
    return_documents: bool
    max_tokens_per_doc: int | None


def plan(req: RerankRequest) -> RerankPlan:
    if not req.documents:
        raise InvalidRequest(
            "documents must not be empty: send the texts to rank", param="documents"
        )
    if len(req.documents) > MAX_DOCUMENTS:
        raise InvalidRequest(
            f"documents has {len(req.documents)} entries; at most {MAX_DOCUMENTS} are "
            "allowed per request. Split them into several requests.",
            param="documents",
        )
    if req.rank_fields is not None and req.rank_fields != ["text"]:
        raise InvalidRequest(
            'rank_fields: only a document\'s "text" is ranked here; leave rank_fields out '
            'or send ["text"]',
            param="rank_fields",
        )
    docs = tuple(d if isinstance(d, str) else d.text for d in req.documents)
    top_n = len(docs) if req.top_n is None else min(req.top_n, len(docs))
    return RerankPlan(req.query, docs, top_n, req.return_documents, req.max_tokens_per_doc)


def inputs(loaded: LoadedEncoder, plan: RerankPlan) -> list[EncodeInput]:
    """The pairs as encoder inputs (off the event loop: tokenizing is the work); a
    decoder reranker's written into its prompt (runtime/text/pair_prompt.py)."""
    if loaded.pair_prompt is not None:
        pairs = loaded.pair_prompt.pairs(
            loaded.tokenizer, plan.query, plan.documents, loaded.max_length,
            plan.max_tokens_per_doc,
        )  # fmt: skip
        return [p.input for p in pairs]
    tok = EncoderTokenizer(loaded.tokenizer, lowercase=loaded.lowercase)
    pairs = tok.pairs(plan.query, plan.documents, loaded.max_length, plan.max_tokens_per_doc)
    return [p.input for p in pairs]
