"""OpenAI response bodies and stream chunks, built as plain dicts."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.types import FinishReason, GenerationStats, TokenLogprob

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(stats: GenerationStats, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def logprobs_content(items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    out = []
    for item in items:
        entry = _token_entry(item.token, item.logprob)
        entry["top_logprobs"] = [_token_entry(t.token, t.logprob) for t in item.top]
        out.append(entry)
    return out


@dataclass
class ChatStream:
    """Shared fields of one chat completion's chunks."""

    model: str
    id: str = field(default_factory=lambda: new_id("chatcmpl"))
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(
        self,
        delta: dict[str, Any],
        *,
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [choice],
        }

    def usage_chunk(self, stats: GenerationStats, reasoning_tokens: int = 0) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(stats, reasoning_tokens),
        }

    def completion(
        self,
        message: dict[str, Any],
        finish_reason: str,
        stats: GenerationStats,
        logprobs: list[dict[str, Any]] | None,
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": logprobs} if logprobs is not None else None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage(stats, reasoning_tokens),
        }
