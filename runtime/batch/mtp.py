"""Drafting with the target's own multi-token-prediction head (`--speculative mtp`).

The head (runtime/models/mtp.py) at position p reads the target's hidden state h_p and
the token at p + 1, and predicts the token at p + 2. A row keeps the head's cache (one
layer's keys and values, `MTPLookup.cache`) over every position whose hidden state the
target computed for it:

- its prompt: each prefill chunk hands its hidden states over (`MTPLookup.prompt`,
  called by runtime/batch/prompt_prefill.py and layered_prefill.py), and they go through
  the head at once, in the chunk's own evaluation: the tokens after them are the
  prompt's. Only the head's keys and values are evaluated (its attention output, MLP
  and LM head are not needed there), so a chunk costs a one-layer projection more and
  is as bounded as the chunk itself: a long prompt never stalls the other rows. The
  prompt's last token is the row's first decode step (alone, or its first verify step).
- its decoding: each verify step hands over the hidden states of the columns it
  committed (`observe`; runtime/batch/speculative.py); they wait until the row next
  drafts, then go through the head in one forward with the tokens that followed them.

A prefix restored from the prefix trie has no hidden states (the trie keeps caches, not
activations): the head's cache then starts where the restored prefix ends. Rotary
attention depends on distances only, so a cache may begin at any position; the head
just sees less context there (the output stays exact either way: drafts are checked).
A row that misses positions anyway (a step taken while drafting was off: a lockstep
group) starts its head's cache again from the next position it sees.

Drafting: the head's output at the newest handed-over position gives the first drafted
token; each further one comes from the head run on its own output and the token it
drafted before (the common practice where a checkpoint ships one MTP layer: vLLM and
SGLang draft k > 1 the same way). The rows drafting in one step feed apart, then run
each later position together, one (B, 1) forward of the head, where their caches batch
without a copy (plain KV caches in row buffers over the CPU kernels' attention:
runtime/cache/rows.py; the draft model batches the same way, runtime/batch/
draft_steps.py); else a forward a row. The drafted positions are then taken back out
of the caches: the next draft starts from the target's hidden states of the tokens the
step accepted.

While the server drafts with MTP every step of the batch is a verify step (drafted
tokens or not), since a pipelined step hands no hidden states over. A drafted token
costs the head's forward (one decoder layer and the LM head), measured as the draft
model's is (`DraftTiming`), and the batch's choice of draft length weighs it. Greedy
rows draft the head's argmax; rows whose sampler draws (runtime/batch/rejection.py)
draw from the head's distribution, checked by rejection sampling. The head's caches
count in the batch's memory budget (`MTPDrafter.projected_bytes`). A row whose head
fails drafts by prompt lookup from then on.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime import kernels as cpu_kernels
from runtime.batch.draft_model import draft_or_look_up, propose_all
from runtime.batch.drafts import Draft, DraftTiming, Lookup
from runtime.batch.rejection import draws, probabilities
from runtime.batch.sequence import Seq
from runtime.cache import BatchCaches, Cache, KVCache
from runtime.models.base import Attention
from runtime.models.mtp import MTPHead, MTPModel
from runtime.types import SamplingParams

log = logging.getLogger(__name__)

# hidden states a row holds for its head before they go through it without a draft
# (each pending slice keeps its verify step's whole hidden array alive)
MAX_PENDING = 32
# (the row's index, its logits (1, V)) -> the token drafted there, (1,), and the
# distribution it was drawn from (None: the argmax)
_Take = Callable[[int, mx.array], None]


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
        self.together = _batches(head, model.mtp_cache())  # later positions in one forward
        self._token_bytes = 0  # a head cache's bytes per position, once one holds some

    def start(self, seq: Seq) -> MTPLookup:
        """The lookup that drafts for a sequence: made when its prompt's prefill begins
        (its chunks feed the head: `MTPLookup.prompt`) or when it joins the batch."""
        req = seq.request
        p = seq.out.progress
        params = req.sampling if draws(req.sampling) and seq.matcher is None else None
        return MTPLookup(self, p.prompt + tuple(p.generated), req.prediction, len(p.prompt),
                         params)  # fmt: skip

    def run(self, hidden: mx.array, tokens: mx.array, cache: Any) -> tuple[mx.array, mx.array]:
        """The head over (B, L, D) hidden states and the (B, L) tokens after them: the
        hidden state a further step reads, (B, 1, D), and the logits at the last
        position, (B, V)."""
        passed, normed = self.absorb(hidden, tokens, cache)
        return passed[:, -1:, :], self.model.logits(normed[:, -1, :])

    def absorb(self, hidden: mx.array, tokens: mx.array, cache: Any) -> tuple[mx.array, mx.array]:
        """The head's forward, lazily: `MTPHead.__call__`'s outputs (evaluating only
        `cache.state` computes its keys and values alone)."""
        embedded = self.model.model.embed_tokens(tokens)
        out: tuple[mx.array, mx.array] = self.head(hidden.astype(embedded.dtype), embedded, cache)
        return out

    def projected_bytes(self, rows: Sequence[Seq]) -> int:
        """What the head's caches of `rows` hold, each grown to its longest (prompt +
        max_tokens), as the running batch projects its own caches (runtime/batch/
        running.py): the scheduler's memory budget counts it."""
        total = 0
        for seq in rows:
            row = seq.lookup
            if not isinstance(row, MTPLookup) or row.owner is None:
                continue
            held = row.cache.nbytes
            if not self._token_bytes:
                keys = getattr(row.cache, "keys", None)
                if keys is not None and held:
                    self._token_bytes = held // max(1, int(keys.shape[-2]))
            longest = len(seq.out.progress.prompt) + seq.out.max_tokens - row.base
            total += max(held, self._token_bytes * longest)
        return total

    def draft_rows(self, rows: Sequence[MTPLookup], counts: Sequence[int]) -> list[Draft]:
        """`counts[i]` tokens drafted for `rows[i]`, all in one evaluation: each row feeds
        its pending hidden states (its first drafted token), then the later positions
        go one forward for all rows where their caches batch (module docstring)."""
        began = time.perf_counter()
        tokens: list[list[mx.array]] = [[] for _ in rows]
        qs: list[list[mx.array]] = [[] for _ in rows]

        def take(i: int, logits: mx.array) -> None:
            token, q = rows[i].pick(logits)
            tokens[i].append(token)
            if q is not None:
                qs[i].append(q)

        passed = []
        for i, row in enumerate(rows):
            out, logits = row.feed_pending()
            passed.append(out)
            take(i, logits)
        if self.together and len(rows) > 1 and max(counts) > 1:
            self._together(rows, counts, passed, tokens, take)
        else:
            for i, row in enumerate(rows):
                for _ in range(1, counts[i]):
                    passed[i], logits = self.run(passed[i], tokens[i][-1].reshape(1, 1), row.cache)
                    take(i, logits)
        ids = [mx.concatenate(t) for t in tokens]
        q_all = [mx.concatenate(q, axis=0) if q else None for q in qs]
        mx.eval(ids, [q for q in q_all if q is not None], [a for r in rows for a in r.cache.state])
        for row in rows:  # the drafted positions are not the target's
            row.cache.restore(None, row.fed)
        self.timing.measured(time.perf_counter() - began, sum(counts))
        out_drafts = []
        for row, drawn_ids, q in zip(rows, ids, q_all, strict=True):
            key = row.split_key() if q is not None else None
            drawn: list[int] = drawn_ids.tolist()  # type: ignore[assignment]
            out_drafts.append(Draft(tuple(int(t) for t in drawn), False, q, key))
        return out_drafts

    def _together(
        self,
        rows: Sequence[MTPLookup],
        counts: Sequence[int],
        passed: list[mx.array],
        tokens: list[list[mx.array]],
        take: _Take,
    ) -> None:
        """The rows' later positions, one (B, 1) forward of the head each: their caches
        joined as views of their row buffers (joining evaluates what each row fed). The
        drafted positions are written past each row's own cache's end, which stays
        where its fed positions end; the batch is dropped afterwards."""
        batch = BatchCaches([rows[0].cache], rows=True)
        for row in rows:
            batch.add([row.cache])
        live = list(range(len(rows)))
        for j in range(1, max(counts)):
            done = [b for b, i in enumerate(live) if counts[i] <= j]
            if done:
                batch.remove(done)
                live = [i for b, i in enumerate(live) if b not in done]
            hidden = mx.concatenate([passed[i] for i in live], axis=0)
            x = mx.concatenate([tokens[i][-1] for i in live]).reshape(len(live), 1)
            out, logits = self.run(hidden, x, batch.layers[0])
            for b, i in enumerate(live):
                passed[i] = out[b : b + 1]
                take(i, logits[b : b + 1])


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
    def owner(self) -> MTPDrafter | None:
        """The drafter, while the head drafts for this row."""
        return self._owner

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

    @property
    def modeled(self) -> bool:
        """Whether its next draft is the head's (not a prediction's, nor prompt lookup's)."""
        return self._owner is not None and not self.following and self.ready

    def _restart(self, position: int) -> None:
        """The head's cache starts again at row position `position`."""
        self.cache.restore(None, 0)
        self.base, self.fed, self.pending, self.waiting = position, 0, [], 0

    def prompt(self, position: int, hidden: mx.array) -> list[mx.array]:
        """A prefill chunk's hidden states (n, D) at prompt positions `position`..: fed
        to the head with the prompt tokens after them, lazily; the arrays the chunk's
        evaluation should include (the head cache's)."""
        if self._owner is None or not hidden.shape[0]:
            return []
        try:
            if position != self.next or self.waiting:
                self._restart(position)
            n = hidden.shape[0]
            after = mx.array(self.tokens[position + 1 : position + 1 + n])[None]
            self._owner.absorb(hidden[None], after, self.cache)
            self.fed += n
            return list(self.cache.state)
        except Exception:
            log.exception("the MTP head failed on a prompt; the row drafts by prompt lookup")
            self.fail()
            return []

    def observe(self, position: int, hidden: mx.array) -> None:
        """The target's hidden states (n, D) at row positions `position`.. (committed by
        a verify step, or the prompt's last token's first step). A gap since the last
        ones starts the head's cache again."""
        if self._owner is None or not hidden.shape[0]:
            return
        if position != self.next:
            self._restart(position)
        self.pending.append(hidden)
        self.waiting += hidden.shape[0]
        if self.waiting > MAX_PENDING:
            try:
                self.feed_pending()
                mx.async_eval(self.cache.state)
            except Exception:
                log.exception("the MTP head failed; the row drafts by prompt lookup")
                self.fail()

    def feed_pending(self) -> tuple[mx.array, mx.array]:
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
        return propose_every([self], [k])[0]

    def fail(self) -> None:
        """The head failed for this row: it drafts by prompt lookup from here on."""
        self._owner = None
        self.close()

    def pick(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """The next drafted token, (1,), and the distribution it was drawn from (None:
        the head's argmax)."""
        logits = logits.astype(mx.float32)
        if self.params is None:
            return mx.argmax(logits, axis=-1).astype(mx.int32), None
        q = probabilities(logits, self.params)
        token = mx.random.categorical(mx.log(q), axis=-1, key=self.split_key())
        return token.astype(mx.int32), q

    def split_key(self) -> mx.array:
        assert self.key is not None
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return keys[1]

    def close(self) -> None:
        """Free the head's cache (the row left the batch)."""
        self.cache.free()
        self.pending, self.waiting = [], 0


def propose_every(lookups: Sequence[Lookup | None], counts: Sequence[int]) -> list[Draft]:
    """Each row's draft of up to `counts[i]` tokens (0: none): the rows the MTP head
    drafts for in one `MTPDrafter.draft_rows`, the others as `propose_all` drafts
    them; rows whose head fails draft by prompt lookup from then on."""
    heads = [i for i, (r, k) in enumerate(zip(lookups, counts, strict=True))
             if k > 0 and isinstance(r, MTPLookup) and r.modeled]  # fmt: skip
    rest = [0 if i in heads else k for i, k in enumerate(counts)]
    out = propose_all(lookups, rest) if any(rest) else [Draft()] * len(lookups)
    if not heads:
        return out
    rows: list[MTPLookup] = [lookups[i] for i in heads]  # type: ignore[misc]
    owner = rows[0].owner
    assert owner is not None
    drafts = draft_or_look_up(owner, rows, [counts[i] for i in heads], "the MTP head")
    for i, d in zip(heads, drafts, strict=True):
        out[i] = d
    return out


def observe_committed(
    rows: Sequence[Seq], starts: Sequence[int], hidden: mx.array, commit: int
) -> None:
    """After a verify step: each MTP row's hidden states (B, L, D) of the `commit`
    columns every row committed; `starts[i]`: row i's position of its column 0."""
    for i, row in enumerate(rows):
        if isinstance(row.lookup, MTPLookup):
            row.lookup.observe(starts[i], hidden[i, :commit])


def _batches(head: MTPHead, cache: object) -> bool:
    """Whether rows' head caches like `cache` join one batch without a copy: a plain KV
    cache read by the CPU kernels' row attention (runtime/models/base.py `rows_layout`
    asks the same of a model's layers)."""
    attn = getattr(head.block, "self_attn", None)
    return (
        type(cache) is KVCache
        and cpu_kernels.rows_ready()
        and isinstance(attn, Attention)
        and attn.softcap is None
        and attn.window is None
    )


def _bytes(params: Any) -> int:
    leaves = tree_flatten(params)
    assert isinstance(leaves, list)
    return sum(int(v.nbytes) for _, v in leaves)
