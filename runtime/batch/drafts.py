"""Speculative decoding's drafts: the tokens a sequence will likely write next, found in
what is already written, and how many of them a step should check.

An agent's output repeats its context: the file it read and now writes back with an
edit, the path and the old string a tool call quotes. `Lookup` finds the longest recent
n-gram ending the sequence (its prompt and output) elsewhere in it, or in the client's
predicted output (OpenAI's Predicted Outputs, searched first), and proposes what followed
there. Drafting is deterministic (a draft is one token, not a distribution), so a step
checks a drafted token by sampling that position as decoding would and comparing: the
output is the one decoding without drafts gives, token for token, at any temperature.

`DraftLength` keeps a row's acceptance: with a per-token acceptance p, k drafted tokens
yield `expected(p, k) = (1 - p^(k+1)) / (1 - p)` tokens. How many tokens the rows of a
batch draft is decided for the batch (runtime/batch/speculative.py): every row pads to
the longest draft, and a verify step costs more than a plain one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx
import numpy as np

from runtime.batch.history import SharedHistory

MAX_DRAFT = 8  # tokens a row drafts at most in one step
LONGEST_NGRAM = 4  # the suffix lengths tried, longest first
SHORTEST_NGRAM = 2
PROBE_AFTER = 32  # steps without a draft before a row that stopped drafting tries again
# off: only a request's predicted output drafts; lookup: its own sequence too; trie: and
# what other conversations wrote (runtime/batch/history.py); draft: a small model with the
# same tokenizer (runtime/batch/draft_model.py); mtp: the target's own multi-token-prediction
# head (runtime/batch/mtp.py)
SPECULATIVE_MODES = ("off", "lookup", "trie", "draft", "mtp")


class Lookup:
    """Prompt lookup over one sequence's tokens and its predicted output."""

    costly: ClassVar[bool] = False  # a draft costs a search, not forwards of a model

    def __init__(
        self,
        tokens: Sequence[int],
        prediction: Sequence[int] = (),
        output_at: int | None = None,
        shared: SharedHistory | None = None,
    ) -> None:
        """`tokens`: the prompt and what the sequence wrote so far, which starts at
        `output_at` (default: nothing written yet); `shared`: other conversations'
        tokens, searched last."""
        self._shared = shared
        self._buf = np.zeros(max(64, 2 * len(tokens)), dtype=np.int32)
        self._n = 0
        self._prediction = np.asarray(prediction, dtype=np.int32)
        self._predicted_at = 0  # the prediction's token the output is expected to write next
        # while the output is the prediction's beginning, the rest of it is the draft
        self._aligned = len(self._prediction) > 0
        self._output_at = len(tokens) if output_at is None else output_at
        self.foreseen = 0  # output tokens the prediction had where they were written
        # where the last draft from the sequence itself was read: (the sequence's length
        # then, the position its draft started at); a copy keeps reading on from there
        self._copying: tuple[int, int] | None = None
        self.extend(tokens)

    def __len__(self) -> int:
        return self._n

    @property
    def tokens(self) -> np.ndarray:
        """The sequence so far (a view: read, do not keep)."""
        return self._buf[: self._n]

    @property
    def following(self) -> bool:
        """Whether the output so far is the prediction's beginning (its rest drafts)."""
        return self._aligned

    @property
    def ready(self) -> bool:
        """Whether it can draft now (a draft model's caches may have to catch up first)."""
        return True

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the sequence wrote (accepted ones only)."""
        start, need = self._n, self._n + len(tokens)
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[start:need] = tokens
        self._n = need
        pred = self._prediction
        for i in range(max(start, self._output_at), need):
            at = self._predicted_at
            if at < len(pred) and pred[at] == self._buf[i]:
                self.foreseen += 1
                self._predicted_at = at + 1
            else:
                self._aligned = False

    def propose(self, k: int) -> Draft:
        """Up to `k` tokens that followed the longest n-gram ending the sequence, at its
        most recent earlier occurrence: in the prediction first, then in the sequence."""
        if k <= 0:
            return Draft()
        if self._aligned:
            at = self._predicted_at
            return Draft(tuple(int(t) for t in self._prediction[at : at + k]), True)
        if self._n < SHORTEST_NGRAM:
            return Draft()
        tokens = self._buf[: self._n]
        copied = self._copy_on(tokens, k)
        if copied is not None:
            return Draft(copied, False)
        for n in range(min(LONGEST_NGRAM, self._n), SHORTEST_NGRAM - 1, -1):
            suffix = tokens[self._n - n :]
            # in the prediction, the match nearest after where the last one left off (a
            # prediction is read in order; text that repeats has several matches)
            hits = _matches(self._prediction, len(self._prediction), suffix)
            if len(hits):
                ahead = hits[hits + n >= self._predicted_at]
                at = int(ahead[0] if len(ahead) else hits[-1])
                follow = self._prediction[at + n : at + n + k]
                if len(follow):
                    self._predicted_at = at + n
                    return Draft(tuple(int(t) for t in follow), True)
            hits = _matches(tokens, self._n - 1, suffix)
            if len(hits):  # in the sequence, the latest
                at = int(hits[-1])
                self._copying = (self._n, at + n)
                return Draft(tuple(int(t) for t in tokens[at + n : at + n + k]), False)
        if self._shared is not None:
            return Draft(self._shared.propose(tokens, k), False)
        return Draft()

    def _copy_on(self, tokens: np.ndarray, k: int) -> tuple[int, ...] | None:
        """The draft that continues the sequence's last source, when what was written
        since still matches it: text copied from the context (a file written back with
        an edit) is read on in order, where the latest match of a short n-gram would jump
        to another place the n-gram repeats (`def`, `self.`, indentation)."""
        if self._copying is None:
            return None
        then, start = self._copying
        at = start + (self._n - then)  # where the copy has got to if all was accepted
        n = min(LONGEST_NGRAM, at)  # the tail it must still match, as a search's
        if at >= self._n or not np.array_equal(tokens[at - n : at], tokens[self._n - n :]):
            self._copying = None
            return None
        return tuple(int(t) for t in tokens[at : min(at + k, self._n)])


@dataclass(frozen=True)
class Draft:
    """Drafted tokens, and whether they came from the client's predicted output.

    A draft model's tokens drawn from its distribution carry it (`q`, one row per drafted
    token) and the key their check draws with (runtime/batch/rejection.py); without `q` a
    draft is deterministic (a one-hot distribution): checked by sampling and comparing."""

    tokens: tuple[int, ...] = ()
    predicted: bool = False
    q: mx.array | None = field(default=None, compare=False)
    key: mx.array | None = field(default=None, compare=False)

    def cut(self, n: int) -> Draft:
        """The first `n` drafted tokens."""
        q = None if self.q is None or n <= 0 else self.q[:n]
        return Draft(self.tokens[:n], self.predicted, q, self.key)


def _matches(source: np.ndarray, limit: int, suffix: np.ndarray) -> np.ndarray:
    """The starts of the occurrences of `suffix` that end before `limit` in `source`,
    in order (the sequence's own suffix is not a match of itself)."""
    n = len(suffix)
    if limit < n:
        return np.zeros(0, dtype=np.int64)
    hits = np.flatnonzero(source[: limit - n + 1] == suffix[0])
    for i in range(1, n):
        if not len(hits):
            break
        hits = hits[source[hits + i] == suffix[i]]
    return hits


@dataclass
class DraftLength:
    """One row's acceptance, and the draft length it pays for (module docstring)."""

    accepted: float = 0.5  # per-token acceptance, a running estimate
    idle: int = 0  # steps since the row last drafted

    @property
    def probing(self) -> bool:
        """A row that drafted nothing for a while tries again (`skip` counts the steps):
        its text may have reached a part that repeats its context, and a good match
        lifts the estimate fast."""
        return self.idle >= PROBE_AFTER

    def expected(self, k: int) -> float:
        """Tokens a step yields with `k` drafted tokens (the corrected or bonus one too)."""
        p = max(0.5, self.accepted) if self.probing else self.accepted
        p = min(p, 0.99)
        return (1.0 - p ** (k + 1)) / (1.0 - p)

    def skip(self) -> None:
        """A step in which the row drafted nothing."""
        self.idle += 1

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify step's outcome: `accepted` of `drafted` tokens matched. Each drafted
        token checked is a trial; a rejection ends the trials of that step."""
        if drafted <= 0:
            return
        if self.idle >= PROBE_AFTER:  # a probe: judge from here on
            self.accepted = max(self.accepted, 0.5)
        self.idle = 0
        trials = accepted + (1 if accepted < drafted else 0)
        self.accepted += (accepted / trials - self.accepted) * 0.4


@dataclass
class DraftTiming:
    """What a draft model's tokens cost: seconds per drafted token (its forwards for one
    row, a running average) and seconds spent drafting in all (runtime/batch/
    speculative.py leaves them out of a verify step's own cost)."""

    seconds: float = 0.0
    spent: float = 0.0
    prior: float = 0.0  # a drafted token's cost in plain steps until one is measured

    def measured(self, took: float, tokens: int) -> None:
        self.spent += took
        if tokens > 0:
            sample = took / tokens
            self.seconds = (
                sample if self.seconds <= 0 else self.seconds + (sample - self.seconds) * 0.2
            )


@dataclass
class DraftCounts:
    """A sequence's drafting, for its usage and the server's counters."""

    drafted: int = 0
    accepted: int = 0
