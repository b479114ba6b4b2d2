"""Why a request reused what it did from the prefix cache, and which prefixes are pinned.

`PrefixCache.begin` files one `CacheReport` per request: how many prompt tokens the
trie matched, how many were restored, and the reason the rest was computed. The
reasons, in the order they are decided:

- `hit`: everything but the last token (which always runs) was reused.
- `off`: the prefix cache is disabled.
- `restore_failed`: a restore failed and the request started clean.
- `evicted`: the cache held more of this prompt, but evicted it (the byte budget).
- `not_snapshotted`: the trie matched further than the caches could be restored: a
  layer that cannot rewind (recurrent, sliding window) has no snapshot at the match,
  so the request resumes from the last restore point before it.
- `diverged`: the cache holds a different continuation from token `at` on (the tokens
  on each side are in the report: a changed system prompt, a re-rendered reply).
- `extends`: all the cache held of this conversation was reused; the rest is new.
- `new`: nothing of the prompt was cached.

Evicted paths are remembered by a hash of their first tokens (bounded memory), so a
later miss can tell "evicted" from "never seen".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from runtime.prefix.trie import Key, Node

CONTEXT_TOKENS = 6  # tokens shown on each side of a divergence
_FINGERPRINT = 8  # first keys of an evicted edge that identify it
_MEMORY = 4096  # evicted edges remembered


class MissReason(str, Enum):
    HIT = "hit"
    OFF = "off"
    RESTORE_FAILED = "restore_failed"
    EVICTED = "evicted"
    NOT_SNAPSHOTTED = "not_snapshotted"
    DIVERGED = "diverged"
    EXTENDS = "extends"
    NEW = "new"


@dataclass(frozen=True)
class CacheReport:
    """One request's use of the prefix cache. `at` is where reuse stopped for `reason`
    (the divergence point for `diverged`; the restore point for `not_snapshotted`)."""

    serial: int
    prompt_tokens: int
    matched: int  # prompt tokens found in the trie (at most prompt_tokens - 1)
    reused: int  # of those, restored into the caches
    reason: MissReason
    at: int
    before: tuple[Key, ...] = ()  # the prompt's tokens just before `at`
    wanted: tuple[Key, ...] = ()  # the prompt's tokens from `at`
    cached: tuple[Key, ...] = ()  # the cache's own tokens from `at` (diverged)
    pin: str | None = None  # "ttl=300s key=..." when the request pinned its prompt

    def describe(self, decode: Callable[[Sequence[int]], str]) -> dict[str, object]:
        """A JSON-ready view with the token ids decoded (images shown as [image])."""
        out: dict[str, object] = {
            "request": self.serial,
            "prompt_tokens": self.prompt_tokens,
            "matched": self.matched,
            "reused": self.reused,
            "computed": self.prompt_tokens - self.reused,
            "reason": self.reason.value,
            "detail": self.detail(),
        }
        if self.reason is MissReason.DIVERGED or self.cached:
            out["divergence"] = {
                "at": self.matched,
                "before": keys_text(self.before, decode),
                "request": keys_text(self.wanted, decode),
                "cached": keys_text(self.cached, decode),
            }
        if self.pin is not None:
            out["pin"] = self.pin
        return out

    def detail(self) -> str:
        r = self.reason
        if r is MissReason.HIT:
            return "the whole prompt was cached"
        if r is MissReason.OFF:
            return "the prefix cache is off (--prefix-cache-bytes 0)"
        if r is MissReason.RESTORE_FAILED:
            return "restoring the cached state failed; computed from scratch"
        if r is MissReason.EVICTED:
            return f"the cache held this prompt past token {self.at} but evicted it"
        if r is MissReason.NOT_SNAPSHOTTED:
            return (
                f"matched {self.matched} tokens, but layers that cannot rewind have no "
                f"snapshot there; resumed from the restore point at token {self.at}"
            )
        if r is MissReason.DIVERGED:
            return f"the prompt differs from the cached one at token {self.at}"
        if r is MissReason.EXTENDS:
            return f"reused the cached conversation whole ({self.at} tokens); the rest is new"
        return "nothing of this prompt was cached (a new conversation)"

    def log_line(self, decode: Callable[[Sequence[int]], str]) -> str:
        line = f"cache {self.reason.value}: reused {self.reused}/{self.prompt_tokens}"
        line += f" (matched {self.matched}); {self.detail()}"
        if self.cached:
            line += (
                f"; at {self.matched}: after {keys_text(self.before, decode)!r} the request has "
                f"{keys_text(self.wanted, decode)!r}, the cache {keys_text(self.cached, decode)!r}"
            )
        return line


def keys_text(keys: Sequence[Key], decode: Callable[[Sequence[int]], str]) -> str:
    """Token ids decoded, each image's span shown once as [image]."""
    out: list[str] = []
    run: list[int] = []
    for key in keys:
        if isinstance(key, int):
            run.append(key)
            continue
        if run:
            out.append(decode(run))
            run = []
        if not out or out[-1] != "[image]":
            out.append("[image]")
    if run:
        out.append(decode(run))
    return "".join(out)


def continuation(path: Sequence[Node], matched: int) -> tuple[Key, ...]:
    """The trie's own keys from `matched` on, where the prompt stopped matching: the rest
    of a partly matched edge, then down the most recently used children."""
    node = path[-1]
    out = list(node.keys[matched - node.start :]) if matched < node.end else []
    while len(out) < CONTEXT_TOKENS and node.children:
        node = max(node.children.values(), key=lambda c: c.last_used)
        out.extend(node.keys)
    return tuple(out[:CONTEXT_TOKENS])


class EvictionMemory:
    """Hashes of evicted edges' first keys, with the prefix before them: enough to say
    that a prompt's continuation was once cached, in bounded memory."""

    def __init__(self, size: int = _MEMORY) -> None:
        self._size = size
        self._seen: OrderedDict[tuple[int, int, int], None] = OrderedDict()

    def remember(self, node: Node) -> None:
        """`node` (still attached to its parent) is about to lose its state."""
        extra = min(len(node.keys), _FINGERPRINT)
        key = (node.start, extra, hash(node.prefix_keys(extra)))
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > self._size:
            self._seen.popitem(last=False)

    def knows(self, keys: Sequence[Key], at: int) -> bool:
        """Was an edge starting at `at` with the prompt's next keys evicted?"""
        if not self._seen:
            return False
        for extra in range(min(_FINGERPRINT, len(keys) - at), 0, -1):
            if (at, extra, hash(tuple(keys[: at + extra]))) in self._seen:
                return True
        return False

    def __len__(self) -> int:
        return len(self._seen)


def report(
    *,
    serial: int,
    keys: Sequence[Key],
    matched: int,
    reused: int,
    cached: tuple[Key, ...],
    evicted_on_path: bool,
    evicted_after: bool,
    failed: bool,
    pin: str | None,
) -> CacheReport:
    """Decide the reason (see the module docstring for the order)."""
    at = matched
    if failed:
        reason = MissReason.RESTORE_FAILED
        at = 0
    elif reused < matched:
        reason = MissReason.EVICTED if evicted_on_path else MissReason.NOT_SNAPSHOTTED
        at = reused
    elif matched >= len(keys) - 1:
        reason = MissReason.HIT
    elif evicted_after:
        reason = MissReason.EVICTED
    elif matched == 0:
        reason, cached = MissReason.NEW, ()
    elif cached:
        reason = MissReason.DIVERGED
    else:
        reason = MissReason.EXTENDS
    start = max(0, matched - CONTEXT_TOKENS)
    return CacheReport(
        serial=serial,
        prompt_tokens=len(keys),
        matched=matched,
        reused=reused,
        reason=reason,
        at=at,
        before=tuple(keys[start:matched]) if cached else (),
        wanted=tuple(keys[matched : matched + CONTEXT_TOKENS]) if cached else (),
        cached=cached,
        pin=pin,
    )


def disabled(serial: int, length: int, pin: str | None) -> CacheReport:
    return CacheReport(serial, length, 0, 0, MissReason.OFF, 0, pin=pin)
