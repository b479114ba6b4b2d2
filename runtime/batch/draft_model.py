"""A draft model: a small model with the target's tokenizer drafts each row's next tokens
(`--speculative draft`), checked in the running batch's verify steps like any draft
(runtime/batch/speculative.py).

It runs on the engine's thread, between the target's steps. Each drafting row keeps its
own caches of the draft model (`ModelLookup`), holding a prefix of the row's accepted
tokens (`held`): to draft k tokens it feeds what it does not hold yet (at least the newest
token) and then its own drafts. The rows drafting in one step feed apart, then draft
each later position together where their caches batch (runtime/batch/draft_steps.py),
all in one lazy graph, evaluated once. The tokens it fed past the accepted ones are
taken back before the next draft: rewinding layers go back to `held`, the others
(recurrent states, sliding windows) restore the state they had there; tokens it drafted
and the target accepted are fed again with the newest one, in the same forward. A row
whose sampler draws (runtime/batch/rejection.py) gets tokens drawn from the draft's
distribution with that distribution; other rows get its argmax.

A row drafts only when its caches are at most `bound` tokens behind it (`ready`). One
further behind (its prompt not read yet, or tokens it wrote while drafting did not pay)
catches up first: each engine step the draft model reads at most `bound` tokens in all
(`catch_up`, from the step's end: runtime/batch/speculative.py): about a decode step's
time of tokens at the measured rate, at most `prefill_chunk`, so a long prompt never
stalls the other rows: they keep decoding meanwhile (holding their drafts: runtime/
batch/speculative.py `behind`).

The draft model has a prefix trie of its own: a row's prompt restores the longest prefix
it holds and the rest is read in chunks through the trie's live caches (runtime/batch/
prompt_prefill.py), one row at a time, when drafting would pay for the row (a row that
never drafts never reads it); a finished row's tokens go back into it (once no prompt is
being read: the live caches are lent to one read at a time). Its trie and its rows'
caches share `budget_bytes` (the rows first). What a drafted token costs is measured
(`DraftTiming`; before the first measure, the models' weight ratio stands for it): the
batch's choice of draft length weighs it (runtime/batch/speculative.py). A row whose draft
model fails drafts by prompt lookup from then on.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from runtime.batch.draft_steps import batches, draft_positions
from runtime.batch.drafts import Draft, DraftTiming, Lookup
from runtime.batch.generate import CausalLM
from runtime.batch.layered_prefill import running_average
from runtime.batch.prompt_prefill import PromptPrefill
from runtime.batch.rejection import draws, probabilities
from runtime.batch.sequence import Seq
from runtime.cache import Snapshot
from runtime.kernels import SMALL_ROWS
from runtime.prefix import PrefixCache
from runtime.text import Tokenizer
from runtime.types import SamplingParams

log = logging.getLogger(__name__)

# a step's catch-up reads about this many decode steps' time of tokens, and no fewer than
# the small-row kernels take in one pass: where a forward of the draft costs least a token
# (on 2 EPYC cores SmolLM2-135M Q4_1 reads 16 tokens in 0.13 s, 17 in 1.8 s)
READ_SHARE = 1.0
MIN_READ = SMALL_ROWS


def check_vocabulary(target: Tokenizer, draft: Tokenizer) -> None:
    """A ValueError unless both tokenizers give every token the same id (a draft is a
    list of token ids: another vocabulary would draft other text)."""
    ours = target.hf.get_vocab(with_added_tokens=True)
    theirs = draft.hf.get_vocab(with_added_tokens=True)
    if ours == theirs:
        return
    differ = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
    token = differ[0]
    raise ValueError(
        f"the draft model's tokenizer is not the target's: {len(differ)} tokens differ "
        f"(the target has {len(ours)}, the draft {len(theirs)}; e.g. {token!r} is "
        f"{ours.get(token)} in the target's, {theirs.get(token)} in the draft's); a draft "
        "model must share the target's tokenizer (a smaller model of the same family)"
    )


class ModelLookup(Lookup):
    """One row's drafting by the draft model (its caches), and prompt lookup's state:
    the row's tokens and predicted output (a prediction it follows drafts first)."""

    costly = True  # a draft costs forwards of the draft model

    def __init__(
        self,
        owner: DraftModel,
        tokens: Sequence[int],
        prediction: Sequence[int],
        prompt: Sequence[int],
        boundaries: Sequence[int],
        params: SamplingParams | None,
    ) -> None:
        super().__init__(tokens, prediction, len(prompt))
        self._owner: DraftModel | None = owner  # None: it failed, prompt lookup drafts
        self.prompt, self.boundaries = tuple(prompt), tuple(boundaries)
        self.caches: list[Any] = []  # its own, once its prompt is read (`read`)
        self.read = False
        self.held = 0  # the row's tokens the caches hold; past them: drafted ones
        self.kept: list[Snapshot | None] = []  # non-rewinding layers' states at `held`
        self.params = params  # not None: drafts are drawn from the draft's distribution
        self.key = mx.random.key(secrets.randbits(63)) if params is not None else None

    @property
    def ready(self) -> bool:
        """Whether it drafts now: by prompt lookup (a prediction it follows, or the draft
        model failed), or from caches at most the draft model's `bound` tokens behind."""
        if self.following or self._owner is None:
            return True
        return not self._owner.lags(self)

    @property
    def owner(self) -> DraftModel | None:
        """The draft model, while it drafts for this row."""
        return self._owner

    @property
    def modeled(self) -> bool:
        """Whether its next draft is the draft model's: not a prediction it follows (free,
        likely right), its caches caught up."""
        return self._owner is not None and not self.following and not self._owner.lags(self)

    def propose(self, k: int) -> Draft:
        if k <= 0:
            return Draft()
        if self.following or self._owner is None:
            return super().propose(k)
        if self._owner.lags(self):  # its caches catch up first (`DraftModel.catch_up`)
            return Draft()
        return propose_all([self], [k])[0]

    def fail(self) -> None:
        """The draft model failed for this row: it drafts by prompt lookup from here on."""
        if self._owner is not None:
            self._owner.drop(self, failed=True)
            self._owner = None

    def split_key(self) -> mx.array:
        assert self.key is not None
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return keys[1]


class DraftModel:
    """The draft model, its prefix trie and its rows (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        make_caches: Callable[[], list[Any]],
        *,
        vocab: int,
        target_vocab: int,
        budget_bytes: int,
        snapshot_interval: int = 1024,
        prefill_chunk: int = 512,
        prior: float = 0.0,
    ) -> None:
        """`vocab`, `target_vocab`: the width of each model's logits (a family's models
        may pad their embeddings differently; only ids both have are drafted); `prior`: a
        drafted token's cost in plain steps until it is measured."""
        self.model = model
        self.prior = prior
        self._make = make_caches
        self.known = min(vocab, target_vocab)
        self.width = target_vocab
        self.budget_bytes = budget_bytes
        self.prefix: PrefixCache[Any] = PrefixCache(
            make_caches, budget_bytes=budget_bytes, snapshot_interval=snapshot_interval
        )
        self.chunk = max(1, prefill_chunk)
        self.bound = self.chunk  # tokens its forwards read at most this step (`catch_up`)
        self.read_rate = 0.0  # tokens/s of the catch-up reads (they size `bound`)
        self.timing = DraftTiming()  # the scheduler's SpecStats shares it
        # rows draft their positions together (runtime/batch/draft_steps.py)
        self.together = batches(model, make_caches())
        self._rows: weakref.WeakSet[ModelLookup] = weakref.WeakSet()
        # the row whose prompt is read through the trie's live caches, one at a time
        self._reading: tuple[ModelLookup, PromptPrefill] | None = None
        # finished rows' tokens and caches, adopted by the trie once no prompt is read
        self._pending: list[tuple[tuple[int, ...], list[Any]]] = []

    # -- a row's life --

    def start(self, seq: Seq) -> ModelLookup:
        """The lookup that drafts for a row joining the batch (its prompt is read when
        it first drafts)."""
        req = seq.request
        p = seq.out.progress
        params = req.sampling if draws(req.sampling) and seq.matcher is None else None
        row = ModelLookup(
            self, p.prompt + tuple(p.generated), req.prediction, p.prompt, req.boundaries, params
        )
        self._rows.add(row)
        return row

    def finished(self, row: ModelLookup) -> None:
        """A row left the batch: the tokens its caches hold go into the draft's trie."""
        if row.read and row in self._rows:
            self._rewind(row)
            held = tuple(int(t) for t in row.tokens[: row.held])
            if held and self.prefix.enabled:
                self._pending.append((held, row.caches))
                row.caches = []
        self.drop(row)

    def drop(self, row: ModelLookup, *, failed: bool = False) -> None:
        """Free a row's caches (it left, or its drafting `failed`)."""
        if self._reading is not None and self._reading[0] is row:
            self._stop_reading(failed)
        self._free(row)
        self._rows.discard(row)
        self._adopt()

    def close(self) -> None:
        """Release every array (the engine stopped)."""
        self._reading = None  # (the trie drops its open lease)
        for _, caches in self._pending:
            for cache in caches:
                cache.free()
        self._pending = []
        for row in list(self._rows):
            self._free(row)
        self._rows = weakref.WeakSet()
        self.prefix.close()

    def _adopt(self) -> None:
        """Finished rows' tokens go into the trie, once its live caches are back."""
        if self._reading is None:
            pending, self._pending = self._pending, []
            for held, caches in pending:
                self.prefix.adopt(held, caches)
                for cache in caches:
                    cache.free()
        self._limit()

    def _limit(self) -> None:
        """The trie keeps what the rows' caches leave of the budget."""
        caches = [c for row in self._rows for c in row.caches]
        caches += [c for _, kept in self._pending for c in kept]
        self.prefix.set_limit(self.budget_bytes - sum(c.nbytes for c in caches))

    # -- catching up --

    def lags(self, row: ModelLookup) -> bool:
        """Whether `row`'s caches lack more than `bound` of its tokens (its prompt not
        read yet, or tokens it wrote while it did not draft): they catch up first."""
        return not row.read or len(row) - row.held > self.bound

    def near(self, row: ModelLookup) -> bool:
        """Whether `row`'s caches hold all its tokens but the newest few, at most `bound`
        (a draft feeds them in one forward)."""
        return row.read and 0 < len(row) - row.held <= self.bound

    def catch_up(self, rows: Sequence[ModelLookup], step_seconds: float) -> None:
        """One engine step's reading for `rows`, behind where drafting would pay: at most
        `bound` tokens in all, sized to take about a decode step (`step_seconds`), the
        row whose prompt is being read first."""
        self.bound = self._sized(step_seconds)
        budget = self.bound
        reading = None if self._reading is None else self._reading[0]
        for row in sorted(rows, key=lambda r: r is not reading):
            if budget <= 0:
                break
            try:
                budget -= self._catch_up(row, budget)
            except Exception:
                log.exception("the draft model failed to read a row; it drafts by prompt lookup")
                row.fail()
        if rows:
            self._limit()

    def _sized(self, step_seconds: float) -> int:
        """A step's reading: what the draft reads in `READ_SHARE` decode steps, as measured
        (`MIN_READ` until then), at most `prefill_chunk`."""
        tokens = int(self.read_rate * step_seconds * READ_SHARE)
        return min(self.chunk, max(MIN_READ, tokens))

    def _catch_up(self, row: ModelLookup, budget: int) -> int:
        """Up to `budget` of the tokens `row`'s caches lack (all but its newest, which its
        draft feeds); how many were read."""
        if not row.read:
            return self._read_prompt(row, budget)
        self._rewind(row)
        n = min(budget, len(row) - row.held - 1)
        if n <= 0:
            return 0
        began = time.perf_counter()
        self.model.forward(mx.array(row.tokens[row.held : row.held + n])[None], row.caches)
        mx.eval([a for c in row.caches for a in c.state])
        row.held += n
        self._read_took(n, time.perf_counter() - began)
        return n

    def _read_prompt(self, row: ModelLookup, budget: int) -> int:
        """Up to `budget` tokens of `row`'s prompt, read through the trie's live caches
        (its longest cached prefix restored first); once all but its last token are in,
        they are copied into the row's own caches and the live ones go back to the trie."""
        if not self.prefix.enabled:  # no trie: the row's own caches read it all
            row.caches, row.held, row.read = self._make(), 0, True
            return self._catch_up(row, budget)
        if self._reading is None:
            lease = self.prefix.begin(row.prompt, boundaries=row.boundaries)
            self._reading = (row, PromptPrefill(lease, row.prompt))
        reader, fill = self._reading
        if reader is not row:
            return 0  # the live caches are another row's until its prompt is in
        began, ran = time.perf_counter(), 0
        pause = functools.partial(self.prefix.snapshot_at, fill.lease)
        while not fill.done and ran < budget:
            got = fill.run(self.model, budget - ran, pause)
            if not got:  # (never: it would hold every row's drafts)
                raise RuntimeError("the draft model's prompt read made no progress")
            ran += got
        if fill.done:
            row.caches = _copied(fill.lease.caches, self._make())
            row.held, row.read = fill.offset, True
            self._stop_reading(failed=False)
        self._read_took(ran, time.perf_counter() - began)
        return ran

    def _stop_reading(self, failed: bool) -> None:
        """The live caches go back to the trie: with the prompt read so far, or dropped
        (`failed`: their state is unknown)."""
        assert self._reading is not None
        (row, fill), self._reading = self._reading, None
        if failed:
            self.prefix.discard(fill.lease)
        else:
            self.prefix.end(fill.lease, row.prompt[: fill.offset])
        self._adopt()

    def _read_took(self, tokens: int, took: float) -> None:
        if tokens > 0 and took > 0:
            self.read_rate = running_average(self.read_rate, tokens / took)

    # -- drafting --

    def draft_rows(self, rows: Sequence[ModelLookup], counts: Sequence[int]) -> list[Draft]:
        """`counts[i]` tokens drafted for `rows[i]` (module docstring): each row feeds what
        its caches lack, then the rows draft their later positions, together where their
        caches batch (runtime/batch/draft_steps.py); evaluated once for all of them."""
        began = time.perf_counter()
        out = [Draft()] * len(rows)
        live, first = [], []
        for i, row in enumerate(rows):
            self._rewind(row)
            if not self.near(row):  # a rewind that failed started its caches over
                continue
            live.append(i)
            first.append(self._feed(row.caches, row.tokens[row.held :]))
            row.held = len(row)
            if counts[i] > 1:  # the states it had here, for layers that cannot rewind
                row.kept = [None if c.rewindable else c.snapshot(0) for c in row.caches]
        if not live:
            return out
        caches = [rows[i].caches for i in live]
        drafted = draft_positions(
            self.model, caches, first, [counts[i] for i in live],
            lambda j, logits: self._pick(logits, rows[live[j]]), together=self.together,
        )  # fmt: skip
        ids = [mx.concatenate(tokens) for tokens, _ in drafted]
        qs = [mx.concatenate(q, axis=0) if q else None for _, q in drafted]
        mx.eval(
            ids, [q for q in qs if q is not None], [a for c in caches for x in c for a in x.state]
        )
        self.timing.measured(time.perf_counter() - began, sum(counts[i] for i in live))
        for i, tokens, q in zip(live, ids, qs, strict=True):
            key = rows[i].split_key() if q is not None else None
            drawn: list[int] = tokens.tolist()  # type: ignore[assignment]
            out[i] = Draft(tuple(int(t) for t in drawn), False, q, key)
        return out

    def _pick(self, logits: mx.array, row: ModelLookup) -> tuple[mx.array, mx.array | None]:
        """The next drafted token, (1,), and the distribution it was drawn from, (1, V) over
        the target's ids (None: the draft's argmax)."""
        logits = logits[:, : self.known].astype(mx.float32)
        if row.params is None:
            return mx.argmax(logits, axis=-1).astype(mx.int32), None
        q = probabilities(logits, row.params)
        if self.width > self.known:
            q = mx.concatenate([q, mx.zeros((1, self.width - self.known), q.dtype)], axis=-1)
        token = mx.random.categorical(mx.log(q), axis=-1, key=row.split_key())
        return token.astype(mx.int32), q

    def _feed(self, caches: list[Any], tokens: Any) -> mx.array:
        """Feed `tokens` (at least one, at most `bound`: `near`) in one forward; the last
        one's logits, (1, V), lazy."""
        hidden = self.model.forward(mx.array(np.asarray(tokens, dtype=np.int32))[None], caches)
        return self.model.logits(hidden[:, -1, :])

    def _rewind(self, row: ModelLookup) -> None:
        """Take back the tokens fed past `held` (drafted ones)."""
        kept, row.kept = row.kept, []
        if not row.caches or row.caches[0].offset == row.held:
            _close(kept)
            return
        ok = True
        for i, cache in enumerate(row.caches):
            snap = kept[i] if i < len(kept) else None
            ok = cache.restore(snap, row.held) and ok
        _close(kept)
        if not ok:
            log.warning("draft model: a row's caches could not rewind; reading it again")
            self._reset(row)

    def _reset(self, row: ModelLookup) -> None:
        """Start the row's caches over: the next draft reads all its tokens again."""
        for cache in row.caches:
            cache.free()
        row.held = 0

    def _free(self, row: ModelLookup) -> None:
        _close(row.kept)
        row.kept = []
        for cache in row.caches:
            cache.free()
        row.caches = []


def propose_all(lookups: Sequence[Lookup | None], counts: Sequence[int]) -> list[Draft]:
    """Each row's draft of up to `counts[i]` tokens (0: none): a draft model's rows in
    one `draft_rows`; a row whose draft model fails drafts by prompt lookup from then on."""
    out = [Draft()] * len(lookups)
    groups: dict[int, list[int]] = {}
    for i, (lookup, k) in enumerate(zip(lookups, counts, strict=True)):
        if lookup is None or k <= 0:
            continue
        if isinstance(lookup, ModelLookup) and lookup.modeled:
            groups.setdefault(id(lookup.owner), []).append(i)
        else:
            out[i] = lookup.propose(k)
    for group in groups.values():
        rows = [lookups[i] for i in group]
        assert all(isinstance(r, ModelLookup) for r in rows)
        owned: list[ModelLookup] = rows  # type: ignore[assignment]
        owner = owned[0].owner
        assert owner is not None
        drafts = draft_or_look_up(owner, owned, [counts[i] for i in group], "the draft model")
        for i, d in zip(group, drafts, strict=True):
            out[i] = d
    return out


def draft_or_look_up(
    owner: Any, rows: Sequence[Any], counts: Sequence[int], what: str
) -> list[Draft]:
    """`owner.draft_rows(rows, counts)` (a draft model's or an MTP head's rows); where it
    fails, each row drafts by prompt lookup from then on (`fail`), and now."""
    try:
        drafts: list[Draft] = owner.draft_rows(rows, counts)
    except Exception:
        log.exception("%s failed; its rows draft by prompt lookup", what)
        for row in rows:
            row.fail()
        drafts = [row.propose(k) for row, k in zip(rows, counts, strict=True)]
    return drafts


def weight_ratio(draft: Any, target: Any) -> float:
    """The draft's parameter bytes over the target's: a decode step reads every weight
    once, so a drafted token costs about this many plain steps (before it is measured)."""
    target_bytes = _parameter_bytes(target)
    return _parameter_bytes(draft) / target_bytes if target_bytes else 0.0


def _parameter_bytes(model: Any) -> int:
    leaves = tree_flatten(model.parameters())
    assert isinstance(leaves, list)
    return sum(int(v.nbytes) for _, v in leaves)


def _copied(caches: Sequence[Any], fresh: list[Any]) -> list[Any]:
    """`fresh` caches holding what `caches` hold (through their snapshots)."""
    for src, dst in zip(caches, fresh, strict=True):
        if src.offset and not dst.restore(src.snapshot(0), src.offset):
            raise RuntimeError(f"the draft model's {type(src).__name__} could not be copied")
    mx.eval([a for c in fresh for a in c.state])
    return fresh


def _close(snapshots: Sequence[Snapshot | None]) -> None:
    for snap in snapshots:
        if snap is not None:
            snap.close()
