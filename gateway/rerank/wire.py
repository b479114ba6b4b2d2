"""The rerank request (Cohere v1/v2 and Jina send this shape). Responses are plain dicts
built in gateway/rerank/emit.py."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    # unknown fields are accepted (and logged by the route's reader)
    model_config = ConfigDict(extra="allow")


class Document(_Wire):
    """A document given as an object (Jina, Cohere v1): its `text` is ranked."""

    text: str


class RerankRequest(_Wire):
    model: str | None = None
    query: str
    documents: list[str | Document]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    # Cohere v2: each document cut to this many tokens before it is paired with the query
    max_tokens_per_doc: int | None = Field(default=None, ge=1)
    # Cohere v1: which fields of object documents to rank; only "text" is
    rank_fields: list[str] | None = None
