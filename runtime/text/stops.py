"""Stop strings over streamed text: cut before the earliest stop, hold back only what might
still become one.

An Aho-Corasick automaton over the stop strings tracks, after every character, the longest
suffix of the text that is a prefix of some stop (its trie node). That suffix is exactly what
must be held back, and a node that ends a stop reports a match, so each fed character costs
amortised O(1) however many stops there are.

"Earliest" means the earliest *start* in the whole text. When a stop completes while a longer
stop that started earlier is still possible, the matcher waits (holding text back) until that
one completes or dies, so the result does not depend on how the text was chunked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class _Automaton:
    """Trie over the stops with failure links; node 0 is the root."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth: list[int] = [0]
        ends: list[bool] = [False]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    ends.append(False)
                node = nxt
            ends[node] = True
        self.fail = [0] * len(self.goto)
        # Longest stop that is a suffix of the text read up to this node (0: none).
        self.match_len = [self.depth[n] if ends[n] else 0 for n in range(len(self.goto))]
        self._link(ends)

    def _link(self, ends: list[bool]) -> None:
        queue = deque(self.goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                target = self.goto[f].get(ch, 0)
                self.fail[child] = target if target != child else 0
                if not ends[child]:
                    self.match_len[child] = self.match_len[self.fail[child]]
                queue.append(child)

    def step(self, node: int, ch: str) -> int:
        while node and ch not in self.goto[node]:
            node = self.fail[node]
        return self.goto[node].get(ch, 0)


class StopMatcher:
    """One request's stop-string filter: ``feed`` text in, text safe to emit out."""

    def __init__(self, stops: Sequence[str]) -> None:
        # An empty stop would match before any text; it carries no meaning, so it is ignored.
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._auto = _Automaton(self.stops)
        self._node = 0
        self._held = ""  # text after what was emitted; ends with the automaton's suffix
        self._match: int | None = None  # start (in _held) of a complete stop awaiting a verdict
        self._matched: str | None = None  # the stop string at _match (reported once hit)
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """A stop string was hit (by ``feed`` or at ``flush``); nothing more is emitted."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string that was hit (None until one is): APIs report which one."""
        return self._matched if self._stopped else None

    @property
    def max_len(self) -> int:
        return max(map(len, self.stops), default=0)

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text to emit now, whether a stop string was hit). After a hit, nothing
        after the stop is ever returned."""
        if self._stopped:
            return "", True
        if not self.stops:
            return text, False
        auto, node, match = self._auto, self._node, self._match
        buf = self._held + text
        pos = len(self._held)
        for ch in text:
            node = auto.step(node, ch)
            pos += 1
            length = auto.match_len[node]
            if length and (match is None or pos - length < match):
                match = pos - length
                self._matched = buf[match:pos]
            # Decided once no stop that starts before the match can still complete.
            if match is not None and pos - auto.depth[node] >= match:
                self._finish()
                return buf[:match], True
        keep_from = len(buf) - auto.depth[node]
        if match is not None:
            keep_from = min(keep_from, match)
            match -= keep_from
        self._node, self._match = node, match
        self._held = buf[keep_from:]
        return buf[:keep_from], False

    def flush(self) -> str:
        """Release the held-back text at the end of generation (cut at a pending stop)."""
        if self._stopped:
            return ""
        held, match = self._held, self._match
        self._held, self._node, self._match = "", 0, None
        if match is None:
            return held
        self._stopped = True
        return held[:match]

    def _finish(self) -> None:
        self._stopped = True
        self._held = ""
        self._node = 0
        self._match = None
