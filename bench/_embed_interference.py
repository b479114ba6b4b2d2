"""bench/embeddings.py's --chat part: a chat stream's decode speed alone, and while a
1,000-input embedding request runs on the same server (the encoder's engine thread
computes it in pieces beside the chat model's: issue 30 asks that it never stalls
running streams).

One server serves the chat model and all-MiniLM-L6-v2. The stream (greedy, a long
story, EOS or --chat-tokens) is measured from its first content chunk to its last; in
the loaded run the embedding request is sent once the stream's first chunk arrives, and
the stream's gaps are taken while the embedding request is in flight.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

PROMPT = "Write a long story about a lighthouse keeper and the storms she remembers."


@dataclass
class Stream:
    times: list[float] = field(default_factory=list)  # arrival of each content chunk

    def rate(self, start: float = 0.0, end: float = float("inf")) -> float:
        inside = [t for t in self.times if start <= t <= end]
        if len(inside) < 2:
            return 0.0
        return (len(inside) - 1) / (inside[-1] - inside[0])

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        inside = [t for t in self.times if start <= t <= end]
        return [b - a for a, b in itertools.pairwise(inside)]


def chat_stream(base: str, model: str, tokens: int, on_first: Callable[[], None]) -> Stream:
    body = {
        "model": model,
        "stream": True,
        "temperature": 0,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    out = Stream()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if delta.get("content"):
                out.times.append(time.perf_counter())
                if len(out.times) == 1:
                    on_first()
    return out


def measure(
    base: str,
    chat_model: str,
    tokens: int,
    embed: Callable[[Sequence[str]], np.ndarray],
    texts: Sequence[str],
) -> dict[str, float]:
    """The stream alone, then with the embedding request beside it."""
    alone = chat_stream(base, chat_model, tokens, lambda: None)
    window: dict[str, float] = {}

    def send() -> None:
        window["start"] = time.perf_counter()
        embed(texts)
        window["end"] = time.perf_counter()

    sender = threading.Thread(target=send)
    loaded = chat_stream(base, chat_model, tokens, sender.start)
    sender.join()
    start, end = window["start"], window["end"]
    during = loaded.gaps(start, end)
    return {
        "decode tok/s alone": alone.rate(),
        "decode tok/s during the embedding request": loaded.rate(start, end),
        "p50 gap alone (ms)": 1000 * statistics.median(alone.gaps()),
        "p50 gap during (ms)": 1000 * statistics.median(during) if during else float("nan"),
        "max gap during (ms)": 1000 * max(during) if during else float("nan"),
        "embeddings/s beside the stream": len(texts) / (end - start),
        "stream tokens during the request": float(len(during) + 1 if during else 0),
    }
