"""The rerank dialect (Cohere's and Jina's shape, as llama.cpp and vLLM serve it): POST
/v1/rerank, with /rerank and /v2/rerank aliases, for cross-encoder models."""

from gateway.rerank.routes import ROUTES

__all__ = ["ROUTES"]
