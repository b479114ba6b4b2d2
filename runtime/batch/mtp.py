"""Drafting with the target's own multi-token-prediction head (`--speculative mtp`).

The head (runtime/models/mtp.py) at position p reads the target's hidden state h_p and
the token at p + 1, and predicts the token at p + 2. A row keeps the head's cache (one
layer's keys and values, `MTPLookup.cache`) over the positions whose hidden states the
batch's verify steps computed: each step hands over the hidden states of the columns it
committed (`observe`; runtime/batch/speculative.py), which wait until the row next
drafts and then go through the head in one forward, with the tokens that followed them.
The head's output at the newest of them gives the first drafted token; each further one
comes from the head run on its own output and the token it drafted before (the common
practice where a checkpoint ships one MTP layer: vLLM and SGLang draft k > 1 the same
way). Those drafted positions are taken back out of its cache at once: the next draft
starts from the target's hidden states of the tokens the step accepted.

While the server drafts with MTP every step of the batch is a verify step (drafted
tokens or not), since a pipelined step hands no hidden states over; a row that missed
positions anyway (a step taken while drafting was off: images, a lockstep group)
starts its head's cache again from the next position it sees. Its context is what the
row decoded in this batch, not its prompt (the prompt's hidden states are computed in
prefill chunks, the prefix trie's restored ones never): rotary attention depends on
distances only, so the cache may begin at any position.

A drafted token costs the head's forward (one decoder layer and the LM head), measured
as the draft model's is (`DraftTiming`), and the batch's choice of draft length weighs
it (runtime/batch/speculative.py). Greedy rows draft the head's argmax; rows whose
sampler draws (runtime/batch/rejection.py) draw from the head's distribution, checked by
rejection sampling. A row whose head fails drafts by prompt lookup from then on.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.batch.drafts import Draft, DraftTiming, Lookup
from runtime.batch.rejection import draws, probabilities
from runtime.batch.sequence import Seq
from runtime.cache import Cache
from runtime.models.mtp import MTPHead, MTPModel
from runtime.types import SamplingParams

log = logging.getLogger(__name__)

# hidden states a row holds for its head before they go through it without a draft
# (each pending slice keeps its verify step's whole hidden array alive)
MAX_PENDING = 32


class MTPDrafter:
    """The target's MTP head, drafting for the rows of the batch (module docstring)."""

    def __init__(self, model: Any) -> None:
        head = model.mtp_head() if isinstance(model, MTPModel) else None
        if head is None:
            name = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
            raise ValueError(
                f"speculative 'mtp' needs the model's multi-token-prediction layer: the "
                f"{name} model was loaded without one (load it with mtp=True)"
            )
        self.head: MTPHead = head
        self.model = model
        self.timing = DraftTiming()  # the scheduler's SpecStats shares it (`attach_mtp`)
        # a drafted token reads the head's weights and the LM head's (before measured)
        lm = model.lm_head if model.lm_head is not None else model.model.embed_tokens
        read = _bytes(head.parameters()) + _bytes(lm.parameters())
        self.prior = read / max(1, _bytes(model.parameters()))

    def start(self, seq: Seq) -> MTPLookup:
        """The lookup that drafts for a row joining the batch."""
        req = seq.request
        p = seq.out.progress
        params = req.sampling if draws(req.sampling) and seq.matcher is None else None
        return MTPLookup(self, p.prompt + tuple(p.generated), req.prediction, len(p.prompt), params)

    def run(self, hidden: mx.array, tokens: mx.array, cache: Cache) -> tuple[mx.array, mx.array]:
        """The head over (1, L, D) hidden states and the (1, L) tokens after them: the
        hidden state a further step reads, and the logits at the last position, (1, V)."""
        embedded = self.model.model.embed_tokens(tokens)
        passed, normed = self.head(hidden.astype(embedded.dtype), embedded, cache)
        return passed[:, -1:, :], self.model.logits(normed[:, -1, :])


class MTPLookup(Lookup):
    """One row's drafting by the MTP head, and prompt lookup's state (a prediction it
    follows drafts first)."""

    costly = True  # a draft costs forwards of the head

    def __init__(
        self,
        owner: MTPDrafter,
        tokens: Sequence[int],
        prediction: Sequence[int],
        output_at: int,
        params: SamplingParams | None,
    ) -> None:
        super().__init__(tokens, prediction, output_at)
        self._owner: MTPDrafter | None = owner  # None: it failed, prompt lookup drafts
        self.cache: Cache = owner.model.mtp_cache()
        self.base = 0  # the row position of the cache's first entry
        self.fed = 0  # positions in the cache (from `base`)
        self.pending: list[mx.array] = []  # (n, D) hidden states not fed yet, in order
        self.waiting = 0  # positions in `pending`
        self.params = params  # not None: drafts are drawn from the head's distribution
        self.key = mx.random.key(secrets.randbits(63)) if params is not None else None

    @property
    def next(self) -> int:
        """The row position whose hidden state comes next."""
        return self.base + self.fed + self.waiting

    @property
    def ready(self) -> bool:
        """Whether it drafts now: a prediction it follows, or the head failed (prompt
        lookup), or it holds the hidden state of every token but the newest."""
        if self.following or self._owner is None:
            return True
        return self.waiting > 0 and self.next == len(self) - 1

    def observe(self, position: int, hidden: mx.array) -> None:
        """The target's hidden states (n, D) at row positions `position`.. (committed by
        a verify step). A gap since the last ones starts the head's cache again."""
        if self._owner is None or not hidden.shape[0]:
            return
        if position != self.next:
            self.cache.restore(None, 0)
            self.base, self.fed, self.pending, self.waiting = position, 0, [], 0
        self.pending.append(hidden)
        self.waiting += hidden.shape[0]
        if self.waiting > MAX_PENDING:
            try:
                self._feed()
                mx.async_eval(self.cache.state)
            except Exception:
                log.exception("the MTP head failed; the row drafts by prompt lookup")
                self._owner = None

    def _feed(self) -> tuple[mx.array, mx.array]:
        """The pending hidden states through the head, lazily, with the tokens after
        them: its output at the newest (`MTPDrafter.run`)."""
        assert self._owner is not None and self.waiting
        start = self.base + self.fed
        hidden = mx.concatenate(self.pending, axis=0)[None]
        after = mx.array(self.tokens[start + 1 : start + 1 + self.waiting])[None]
        out = self._owner.run(hidden, after, self.cache)
        self.fed += self.waiting
        self.pending, self.waiting = [], 0
        return out

    def propose(self, k: int) -> Draft:
        if k <= 0:
            return Draft()
        if self.following or self._owner is None:
            return super().propose(k)
        if not self.ready:
            return Draft()
        try:
            return self._draft(self._owner, k)
        except Exception:
            log.exception("the MTP head failed; the row drafts by prompt lookup")
            self._owner = None
            return super().propose(k)

    def _draft(self, owner: MTPDrafter, k: int) -> Draft:
        """`k` tokens: the first from the target's newest hidden state, the others from
        the head's own output (module docstring); the drafted positions rewound."""
        began = time.perf_counter()
        passed, logits = self._feed()
        tokens, qs = [], []
        for j in range(k):
            token, q = self._pick(logits)
            tokens.append(token)
            if q is not None:
                qs.append(q)
            if j + 1 < k:
                passed, logits = owner.run(passed, token.reshape(1, 1), self.cache)
        ids = mx.concatenate(tokens)
        q_all = mx.concatenate(qs, axis=0) if qs else None
        mx.eval(ids, *([] if q_all is None else [q_all]), self.cache.state)
        self.cache.restore(None, self.fed)  # the drafted positions are not the target's
        owner.timing.measured(time.perf_counter() - began, k)
        drawn: list[int] = ids.tolist()  # type: ignore[assignment]
        key = self._split_key() if q_all is not None else None
        return Draft(tuple(int(t) for t in drawn), False, q_all, key)

    def _pick(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """The next drafted token, (1,), and the distribution it was drawn from (None:
        the head's argmax)."""
        logits = logits.astype(mx.float32)
        if self.params is None:
            return mx.argmax(logits, axis=-1).astype(mx.int32), None
        q = probabilities(logits, self.params)
        token = mx.random.categorical(mx.log(q), axis=-1, key=self._split_key())
        return token.astype(mx.int32), q

    def _split_key(self) -> mx.array:
        assert self.key is not None
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return keys[1]

    def close(self) -> None:
        """Free the head's cache (the row left the batch)."""
        self.cache.free()
        self.pending, self.waiting = [], 0


def observe_committed(
    rows: Sequence[Seq], starts: Sequence[int], hidden: mx.array, commit: int
) -> None:
    """After a verify step: each MTP row's hidden states (B, L, D) of the `commit`
    columns every row committed; `starts[i]`: row i's position of its column 0."""
    for i, row in enumerate(rows):
        if isinstance(row.lookup, MTPLookup):
            row.lookup.observe(starts[i], hidden[i, :commit])


def _bytes(params: Any) -> int:
    leaves = tree_flatten(params)
    assert isinstance(leaves, list)
    return sum(int(v.nbytes) for _, v in leaves)
