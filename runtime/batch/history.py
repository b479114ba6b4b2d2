"""What other conversations on this server wrote, for drafting (`--speculative trie`).

The prefix trie keeps every finished sequence's tokens (its prompt and its output) so a
later request can resume from them; agents write the same code, paths and tool calls in
several conversations (a subagent's task, a retried turn, two sessions on one repository).
`SharedHistory` keeps the same sequences' tokens, the latest first, up to a bound, with an
index from each 3-gram to its latest occurrence: a row whose own sequence has no match
for its last tokens drafts what followed them in another conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

NGRAM = 3
DEFAULT_TOKENS = 1 << 20  # tokens kept (4 MB of ids, and the index over them)


def _keys(tokens: np.ndarray) -> np.ndarray:
    """One int64 per 3-gram starting at each position (ids below 2^21: exact)."""
    t = tokens.astype(np.int64)
    return (t[:-2] << 42) | (t[1:-1] << 21) | t[2:]


class SharedHistory:
    """Finished sequences' tokens and a 3-gram index over them (module docstring)."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._seqs: OrderedDict[int, np.ndarray] = OrderedDict()  # id -> tokens, oldest first
        self._index: dict[int, tuple[int, int]] = {}  # 3-gram -> (id, position after it)
        self._next_id = 0
        self._held = 0

    @property
    def tokens(self) -> int:
        return self._held

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        """A finished sequence (prompt and output). Its 3-grams point here from now on;
        the oldest sequences go when the bound is passed."""
        arr = np.array(tokens, dtype=np.int32)  # a copy: a view would keep its buffer
        if len(arr) <= NGRAM or int(arr.max(initial=0)) >= 1 << 21:
            return
        arr = arr[-self.max_tokens :].copy()
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = arr
        self._held += len(arr)
        ends = range(NGRAM, len(arr) + 1)
        self._index.update(zip(_keys(arr).tolist(), ((seq_id, e) for e in ends), strict=True))
        while self._held > self.max_tokens and len(self._seqs) > 1:
            _, old = self._seqs.popitem(last=False)
            self._held -= len(old)
        if len(self._index) > 4 * self._held:  # entries of dropped sequences: rebuild
            self._rebuild()

    def _rebuild(self) -> None:
        self._index = {}
        for seq_id, arr in self._seqs.items():
            ends = range(NGRAM, len(arr) + 1)
            self._index.update(zip(_keys(arr).tolist(), ((seq_id, e) for e in ends), strict=True))

    def propose(self, suffix: np.ndarray, k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed `suffix`'s last 3 tokens where another sequence
        last wrote them."""
        if k <= 0 or len(suffix) < NGRAM:
            return ()
        key = int(_keys(np.asarray(suffix[-NGRAM:], dtype=np.int32))[0])
        hit = self._index.get(key)
        if hit is None or hit[0] not in self._seqs:
            return ()
        arr = self._seqs[hit[0]]
        return tuple(int(t) for t in arr[hit[1] : hit[1] + k])
