"""Pinned prompts: prefixes a client asked to keep cached (Anthropic cache_control,
OpenAI prompt_cache_key), ranked ahead of unpinned ones in the prefix cache's eviction
until their TTL runs out.

A pin is kept as the prompt's keys, not as trie nodes: nodes split and merge as
conversations branch and state is evicted, while a key sequence always finds the
nodes that currently hold it. A pin whose keys start another, newer pin's keys and
that expires no later is folded into it (an agent's every turn extends the last), and
at most `limit` pins are held (the soonest to expire go first), so the set stays small.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime.prefix.trie import Key, Trie
from runtime.types import PrefixPin

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 64


@dataclass
class _Pin:
    keys: tuple[Key, ...]
    until: float
    ttl: float
    key: str | None


def label(pin: PrefixPin) -> str:
    """How a pin shows in reports and logs."""
    text = f"ttl={pin.ttl:g}s"
    return f"{text} key={pin.key}" if pin.key else text


class Pins:
    def __init__(self, clock: Callable[[], float], limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError("a pin limit must be at least 1")
        self._clock = clock
        self._limit = limit
        self._pins: list[_Pin] = []

    def add(self, keys: Sequence[Key], pin: PrefixPin) -> None:
        if pin.ttl <= 0:
            return
        now = self._clock()
        new = _Pin(tuple(keys), now + pin.ttl, pin.ttl, pin.key)
        kept = [
            p
            for p in self._live(now)
            if not (p.until <= new.until and new.keys[: len(p.keys)] == p.keys)
        ]
        kept.append(new)
        if len(kept) > self._limit:
            kept.sort(key=lambda p: p.until, reverse=True)
            for dropped in kept[self._limit :]:
                log.info(
                    "prefix cache: more than %d pins; unpinning %s", self._limit, _name(dropped)
                )
            kept = kept[: self._limit]
        self._pins = kept

    def _live(self, now: float) -> list[_Pin]:
        return [p for p in self._pins if p.until > now]

    def nodes(self, trie: Trie) -> set[int]:
        """Ids of the trie nodes holding a live pin's keys (a partly held edge counts:
        its state restores the pinned part too). Closed under parents, since every
        pin's path starts at the root."""
        self._pins = self._live(self._clock())
        held: set[int] = set()
        for pin in self._pins:
            path, _ = trie.match(pin.keys)
            held.update(id(n) for n in path[1:])
        return held

    def describe(self, trie: Trie) -> list[dict[str, object]]:
        now = self._clock()
        self._pins = self._live(now)
        out: list[dict[str, object]] = []
        for pin in sorted(self._pins, key=lambda p: p.until):
            _, cached = trie.match(pin.keys)
            out.append(
                {
                    "key": pin.key,
                    "ttl_seconds": pin.ttl,
                    "expires_in_seconds": round(pin.until - now, 1),
                    "tokens": len(pin.keys),
                    "matched_tokens": cached,
                }
            )
        return out

    def __len__(self) -> int:
        return len(self._live(self._clock()))


def _name(pin: _Pin) -> str:
    return f"{len(pin.keys)} tokens" + (f" (key {pin.key})" if pin.key else "")
