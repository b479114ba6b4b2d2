"""The rerank response: results best first, each with the document's index in the
request, its relevance score and (unless return_documents is false) the document.

Scores are the cross-encoder's own outputs after its activation, as
sentence-transformers' CrossEncoder.predict gives them: a sigmoid of the logit (0 to 1)
for the usual one-label rerankers, or the raw logit for a model whose config names the
identity activation (`sentence_transformers.activation_fn`). Ties keep request order."""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.rerank.adapt import RerankPlan


def body(
    model_id: str, plan: RerankPlan, scores: npt.NDArray[np.float32], tokens: int
) -> dict[str, Any]:
    order = np.argsort(-scores, kind="stable")[: plan.top_n]
    results = []
    for index in order:
        item: dict[str, Any] = {"index": int(index), "relevance_score": float(scores[index])}
        if plan.return_documents:
            item["document"] = {"text": plan.documents[index]}
        results.append(item)
    return {
        "id": "rerank-" + secrets.token_hex(12),
        "model": model_id,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "meta": {"billed_units": {"search_units": 1}},
    }
