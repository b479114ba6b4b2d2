"""OpenAI response bodies and stream chunks (chat and text completions), built as plain dicts."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.types import FinishReason, GenerationStats, TokenLogprob

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class Usage:
    """Token counts of one API request, summed over its generations. The prompt counts
    once per distinct prompt, as OpenAI bills it, however many choices share it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def add(
        self, stats: GenerationStats, *, first_of_prompt: bool, reasoning_tokens: int = 0
    ) -> None:
        if first_of_prompt:
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += stats.cached_tokens
        self.completion_tokens += stats.completion_tokens
        self.reasoning_tokens += reasoning_tokens
        self.accepted_prediction_tokens += stats.accepted_prediction_tokens
        self.rejected_prediction_tokens += stats.rejected_prediction_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {
                "reasoning_tokens": self.reasoning_tokens,
                "accepted_prediction_tokens": self.accepted_prediction_tokens,
                "rejected_prediction_tokens": self.rejected_prediction_tokens,
            },
        }


def usage(stats: GenerationStats, reasoning_tokens: int = 0) -> dict[str, Any]:
    one = Usage()
    one.add(stats, first_of_prompt=True, reasoning_tokens=reasoning_tokens)
    return one.body()


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def logprobs_content(items: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    out = []
    for item in items:
        entry = _token_entry(item.token, item.logprob)
        entry["top_logprobs"] = [_token_entry(t.token, t.logprob) for t in item.top]
        out.append(entry)
    return out


def legacy_logprobs(items: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """The /v1/completions shape: parallel lists, offsets into the choice's text."""
    tokens, logprobs, tops, offsets = [], [], [], []
    at = text_offset
    for item in items:
        tokens.append(item.token)
        logprobs.append(item.logprob)
        tops.append({t.token: t.logprob for t in item.top})
        offsets.append(at)
        at += len(item.token)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@dataclass
class _Envelope:
    model: str
    id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }


@dataclass
class ChatStream(_Envelope):
    """Shared fields of one chat completion's chunks and body."""

    id: str = field(default_factory=lambda: new_id("chatcmpl"))

    def chunk(
        self,
        delta: dict[str, Any],
        *,
        index: int = 0,
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
        choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
        return self._wrap("chat.completion.chunk", [choice])

    def usage_chunk(self, totals: Usage) -> dict[str, Any]:
        return self._wrap("chat.completion.chunk", [], usage=totals.body())

    @staticmethod
    def choice(
        index: int,
        message: dict[str, Any],
        finish_reason: str,
        logprobs: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": finish_reason,
        }

    def completion(self, choices: list[dict[str, Any]], totals: Usage) -> dict[str, Any]:
        return self._wrap("chat.completion", choices, usage=totals.body())


@dataclass
class TextStream(_Envelope):
    """Shared fields of one text completion's chunks and body (/v1/completions)."""

    id: str = field(default_factory=lambda: new_id("cmpl"))

    @staticmethod
    def choice(
        index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return self._wrap("text_completion", [choice])

    def usage_chunk(self, totals: Usage) -> dict[str, Any]:
        return self._wrap("text_completion", [], usage=totals.body())

    def completion(self, choices: list[dict[str, Any]], totals: Usage) -> dict[str, Any]:
        return self._wrap("text_completion", choices, usage=totals.body())
