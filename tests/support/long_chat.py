"""A streamed chat completion that runs until the test stops it: a request that is surely
in the running batch while the test looks (no timing involved). Its max_tokens fills the
context; stopping closes the connection at the next chunk, which cancels the request.

It samples (seeded): a random model's greedy output can settle on a token with no text,
and then no chunk comes to notice the stop at."""

from __future__ import annotations

import threading
from typing import Any

import httpx


class LongChat(threading.Thread):
    def __init__(
        self, base: str, model: str, messages: list[dict[str, Any]], max_tokens: int,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.body = {
            "model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": 7, "stream": True,
        }  # fmt: skip
        self.url = base + "/v1/chat/completions"
        self.headers = headers
        self.streaming = threading.Event()  # its first chunk came
        self.stop = threading.Event()
        self.status: int | None = None

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=120) as r:
            self.status = r.status_code
            for _ in r.iter_lines():
                self.streaming.set()
                if self.stop.is_set():
                    return

    def end(self) -> None:
        self.stop.set()
        self.join(60)
        assert not self.is_alive(), "the stream did not end"
