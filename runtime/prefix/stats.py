"""What the prefix cache did: its counters, and the last requests' reports
(runtime/prefix/report.py) that the debug view shows.
"""

from __future__ import annotations

from collections import Counter, deque

from runtime.prefix.report import CacheReport
from runtime.prefix.trie import DeferredSnapshot, Trie

COUNTS: tuple[str, ...] = ("requests", "hits", "prompt_tokens", "reused_tokens", "page_outs")
COUNTS += ("evictions", "pinned_evictions", "restore_failures", "discards", "adopted")


class CacheStats:
    """The counters (bumped by the cache, its eviction and a lockstep rank's replay) and
    a bounded history of reports, oldest first."""

    def __init__(self, reports: int) -> None:
        self.counts: Counter[str] = Counter()
        self._reports: deque[CacheReport] = deque(maxlen=reports)

    def began(self, prompt_tokens: int) -> None:
        """A request began (counted before its lookup, which may fail)."""
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += prompt_tokens

    def file(self, report: CacheReport) -> None:
        """The request's lookup is done: what it reused, and why not more."""
        self.counts["hits"] += report.reused > 0
        self.counts["reused_tokens"] += report.reused
        self._reports.append(report)

    def recent(self) -> list[CacheReport]:
        return list(self._reports)

    def summary(
        self,
        trie: Trie,
        *,
        live_tokens: int,
        pins: int,
        budget_bytes: int,
        limit_bytes: int,
        disk: dict[str, int] | None,
    ) -> dict[str, int]:
        """The counters with the trie's size and bounds (and the disk tier's, if any)."""
        nodes = list(trie.walk())
        held = [s for n in nodes for s in n.snapshots if s is not None]
        on_disk = sum(isinstance(s, DeferredSnapshot) for s in held)
        return {
            **{k: self.counts[k] for k in COUNTS},
            "nodes": len(nodes) - 1,
            "snapshots": len(held) - on_disk,
            "paged_bytes": trie.paged_bytes,
            "budget_bytes": budget_bytes,
            "limit_bytes": limit_bytes,
            "live_tokens": live_tokens,
            "pins": pins,
            **({} if disk is None else {"disk_snapshots": on_disk, **disk}),
        }
