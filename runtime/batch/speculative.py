"""Speculative decoding in the running batch: drafted tokens checked in one forward.

A verify step feeds each row the tokens it knows (the newest sampled one last) and the
tokens it drafted (runtime/batch/drafts.py), padded to one length L, through one forward
over the batch's caches. Each row then samples position by position, under its own
sampler and grammar exactly as decoding would: the token sampled after the known tokens,
then, while the sampled token equals the drafted one, the token after that. The first
mismatch is the row's next token (it corrects the draft); if every drafted token
matched, the last sample is a token gained for free. The sampler sees only the tokens
it would have seen without drafts (penalties, logit_bias, seeds, reasoning budgets), and
the grammar is never advanced past a token it did not sample, so the output equals
decoding without speculation at any temperature, given the same logits: the verify
rows' attention is split as a one-token step's would be (runtime/kernels/
decode_attention.c), and the small-row matmuls compute each row on its own.

The batch's token caches keep every row's newest token in one column (left padding), so
a step commits the same number of columns for every row: the fewest any row kept. A row
that kept more feeds those tokens again next step (known tokens, never sampled twice);
the rejected columns are rewound, so the prefix trie only ever sees accepted tokens. A
row drafts what its known tokens leave of the step's length: one that kept fewer drafts
as many as the others feed again, and accepted, lets them commit. A hybrid's recurrent
layers cannot forget tokens: through a verify forward they keep their states after each
position, one token at a time as decoding computes them, and rewinding takes the states
after the committed columns (runtime/cache/batch_recurrent.py).

Steps are synchronous (a row's draft needs its newest token on the host); the batch goes
back to pipelined decode (runtime/batch/running.py) as soon as no row drafts.

With a draft model (runtime/batch/draft_model.py), rows whose sampler draws get drafts
drawn from the draft's distribution, checked by rejection sampling (runtime/batch/
rejection.py): the output keeps the target's distribution, not its exact tokens. Its
forwards cost time, measured, which the choice of draft length weighs. A row whose
draft caches lag (a long prompt) catches up a bounded read a step, and meanwhile no
row drafts (`behind`): the others' accepted drafts would only be fed again each step.

With the target's MTP head (runtime/batch/mtp.py) every step verifies: each hands the
head the hidden states of the columns it committed (`observe_committed`); a row's
prompt chunks hand theirs over as they are read (`prefilling`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx

from runtime.batch.draft_model import DraftModel, ModelLookup
from runtime.batch.drafts import MAX_DRAFT, SPECULATIVE_MODES, Draft, DraftTiming, Lookup
from runtime.batch.generate import SampledToken, read_sampled
from runtime.batch.history import SharedHistory
from runtime.batch.mtp import MTPDrafter, MTPLookup, observe_committed, propose_every
from runtime.batch.rejection import checked_tokens
from runtime.batch.running import Agree, RunningBatch
from runtime.batch.sequence import Seq
from runtime.types import GenerationRequest

log = logging.getLogger(__name__)

# tokens a verify step's rows may hold in all (rows x L): the small-row kernels' range
# (runtime/kernels/primitives.SMALL_ROWS) and the decode attention's (16 per row)
VERIFY_ROWS = 16
VERIFY_LENGTH = 16


@dataclass
class SpecStats:
    """The running batch's drafting, for /metrics, and what a verify row costs here."""

    steps: int = 0  # verify steps taken
    drafted: int = 0
    accepted: int = 0
    # A step's forward costs a fixed part and a part per token row (the small-row
    # kernels' time grows with the rows): with `ratio` the cost of a token row over the
    # fixed part, a verify step of B rows of L tokens costs 1 + beta(B) * (L - 1) plain
    # steps, beta(B) = B * ratio / (1 + B * ratio). Measured on the running batch;
    # Qwen2.5-0.5B on 2 EPYC cores: beta(1) 0.3, so ratio 0.45 and beta(8) 0.78.
    ratio: float = 0.45
    # False: the ratio holds and a draft model's tokens cost nothing (tests pin the model)
    measure: bool = True
    # a verify step is synchronous: the host's work no longer overlaps the forward
    sync: float = 0.08
    draft: DraftTiming = field(default_factory=DraftTiming)  # a draft model's, measured
    plain: float = 0.0  # a plain step's seconds, as the scheduler last measured it

    def beta(self, rows: int) -> float:
        return rows * self.ratio / (1.0 + rows * self.ratio)

    def draft_cost(self) -> float:
        """A draft model's drafted token (its forward for one row) in plain steps."""
        if not self.measure:
            return 0.0
        if self.draft.seconds > 0 and self.plain > 0:
            return self.draft.seconds / self.plain
        return self.draft.prior

    def measured(self, rows: int, length: int, took: float, plain: float) -> None:
        """A verify step of `rows` rows of `length` tokens took `took` seconds from its
        forward to its last sample; a plain step takes `plain`."""
        if self.measure and length > 1 and plain > 0:
            # the step's own overhead (`sync`) is not the rows'; a short verify says
            # little about a row's cost, so a sample weighs by its extra rows
            beta = min(0.95, max(0.02, (took / plain - 1.0 - self.sync) / (length - 1)))
            sample = beta / (rows * (1.0 - beta))
            self.ratio += (sample - self.ratio) * 0.2 * min(1.0, (length - 1) / 6)


class Speculation:
    """A scheduler's speculative decoding: whether its sequences draft unless their
    request says (`enabled`), whether the next step verifies, and what it measured."""

    def __init__(self, mode: str = "off", *, allowed: bool = True) -> None:
        if mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, not {mode!r}")
        self.enabled = mode != "off"
        self.allowed = allowed  # False: nothing drafts (a distributed group's lockstep)
        # `trie`: what finished sequences wrote, drafted from by every row
        self.history = SharedHistory() if mode == "trie" else None
        self.stats = SpecStats()
        self.verifying = False  # the next step is a verify step
        self.model: DraftModel | None = None  # `draft`: the draft model (`attach`)
        self.mtp: MTPDrafter | None = None  # `mtp`: the target's MTP head (`attach_mtp`)

    def attach(self, model: DraftModel) -> None:
        """Draft with `model` (`--speculative draft`); its cost goes into the stats."""
        self.model = model
        model.timing = self.stats.draft
        self.stats.draft.prior = model.prior

    def attach_mtp(self, drafter: MTPDrafter) -> None:
        """Draft with the target's MTP head (`--speculative mtp`); its cost goes into
        the stats."""
        self.mtp = drafter
        drafter.timing = self.stats.draft
        self.stats.draft.prior = drafter.prior

    def close(self) -> None:
        if self.model is not None:
            self.model.close()

    def drafts(self, request: GenerationRequest) -> bool:
        """Whether a request's sequence drafts: as it says, else when it has a predicted
        output, else as the server's setting."""
        if not self.allowed:
            return False
        if request.speculative is not None:
            return request.speculative
        return self.enabled or bool(request.prediction)

    def prefilling(self, seq: Seq, *, batched: bool) -> None:
        """A sequence's prompt starts its prefill: with the MTP head (and a `batched`
        running batch), the row's drafting state begins here, and the prefill hands it
        each chunk's hidden states."""
        if self.mtp is None or not batched or seq.images is not None or seq.prefill is None:
            return
        if self.drafts(seq.request):
            lookup = self.mtp.start(seq)
            seq.lookup, seq.prefill.hidden_to = lookup, lookup.prompt

    def first_step(self, seq: Seq, hidden: mx.array) -> None:
        """A sequence's first token was sampled alone: the hidden state (1, D) of its
        prompt's last token, for its MTP head."""
        if isinstance(seq.lookup, MTPLookup):
            seq.lookup.observe(len(seq.out.progress.prompt) - 1, hidden)

    def held_bytes(self, rows: list[Seq]) -> int:
        """What drafting's caches of `rows` hold at their longest (an MTP head's), for
        the scheduler's memory budget."""
        return 0 if self.mtp is None else self.mtp.projected_bytes(rows)

    def start(self, seq: Seq, batch: RunningBatch | None = None) -> None:
        """Drafting state for a sequence joining `batch`: its prompt and output so far,
        and its prediction. A row the MTP head drafts for verifies from its first step
        on (a pipelined step would hand its first hidden state over to nobody)."""
        if self.mtp is not None and seq.images is None:
            if not isinstance(seq.lookup, MTPLookup):  # (else begun by `prefilling`)
                seq.lookup = self.mtp.start(seq)
            if batch is not None and _hands_hidden(batch.rows) and can_speculate(batch):
                self.verifying = True
            return
        if self.model is not None and seq.images is None:
            try:
                seq.lookup = self.model.start(seq)
                return
            except Exception:  # the row drafts by prompt lookup instead
                log.exception("the draft model failed to read a prompt")
        p = seq.out.progress
        seq.lookup = Lookup(
            p.prompt + tuple(p.generated), seq.request.prediction, len(p.prompt), self.history
        )

    def finished(self, seq: Seq) -> None:
        """A sequence left the batch: what it wrote is there for others to draft from."""
        if self.history is not None and seq.lookup is not None:
            self.history.add(seq.lookup.tokens)
        if self.model is not None and isinstance(seq.lookup, ModelLookup):
            self.model.finished(seq.lookup)
        if isinstance(seq.lookup, MTPLookup):
            seq.lookup.close()

    def step(self, batch: RunningBatch, plain: float, agree: Agree) -> list[int]:
        """A verify step (`verify_step`); `plain`: a plain step's seconds."""
        return verify_step(batch, self.stats, plain, agree)[0]

    def plan(self, batch: RunningBatch, step_seconds: float = 0.0) -> None:
        """Decide whether the next step verifies, after a draft model's rows that are
        behind caught up by one step's reading (`DraftModel.catch_up`; `step_seconds`: a
        plain step's); when the batch goes back to pipelined steps, rows forget the
        tokens a verify step would feed."""
        before = self.verifying
        able = bool(batch.rows) and can_speculate(batch)
        if able and self.model is not None:
            self.model.catch_up(behind(batch.rows, self.stats), step_seconds)
        # MTP rows need every step's hidden states: a pipelined step hands none over
        self.verifying = able and (_hands_hidden(batch.rows) or wants_drafts(batch, self.stats))
        if before and not self.verifying:
            for row in batch.rows:
                row.feed = []


def can_speculate(batch: RunningBatch) -> bool:
    """Whether the batch's rows can verify drafts: batched caches (token caches rewind;
    a hybrid's recurrent layers keep their states at each verified position), text
    positions (no image rope shift)."""
    return batch.caches is not None and all(r.shift == 0 for r in batch.rows)


def _hands_hidden(rows: list[Seq]) -> bool:
    """Whether a row drafts with the MTP head (runtime/batch/mtp.py)."""
    return any(isinstance(r.lookup, MTPLookup) and r.lookup.owner is not None for r in rows)


def wants_drafts(batch: RunningBatch, stats: SpecStats) -> bool:
    """Whether the next step should be a verify step: some row has known tokens to feed
    again, or drafts worth checking (after a pipelined step, judged without the token
    still on its way: a match at the sequence's end is what makes one likely)."""
    rows = batch.rows
    if any(len(row.feed) > 1 for row in rows):
        return True
    if any(r.lookup is not None and r.lookup.costly for r in rows):
        # a draft model drafts whatever length it is asked: judged without drafting
        if not behind(rows, stats) and _best_length(rows, _offered(rows), stats):
            return True
        for row in rows:
            row.drafting.skip()
        return False
    return any(d.tokens for d in plan_drafts(rows, stats))


def behind(rows: list[Seq], stats: SpecStats) -> list[ModelLookup]:
    """The draft model's rows whose caches must catch up before they draft, where
    drafting would pay were they caught up (none where it would not: they read nothing).
    Meanwhile no row drafts: a step commits as many columns for every row as the row
    that kept fewest, so the others' accepted drafts would be fed again step after step
    (at a verify step's cost) until the rows catching up could draft as many."""
    late = [r.lookup for r in rows if isinstance(r.lookup, ModelLookup) and not r.lookup.ready]
    if not late:
        return []
    return late if _best_length(rows, _offered(rows, every=True), stats) else []


def plan_drafts(rows: list[Seq], stats: SpecStats) -> list[Draft]:
    """Each row's draft for one step, the batch's draft length chosen together: every
    row pads to the longest, so a length is worth what all rows expect to gain from it
    (a row without a draft gains nothing) against what the step costs, and nothing is
    drafted where no length beats the step the batch would take without drafts. Within
    the budget of rows x L tokens: a row drafts what its known tokens leave of L. The
    rows' texts are searched only where drafts of every length offered could pay; a
    draft model is asked for that length only."""
    offers = [Draft()] * len(rows)
    room = _offered(rows)
    first = 0 if behind(rows, stats) else _best_length(rows, room, stats)
    if first:
        asks = [_ask(r, min(first, n)) if n else 0 for r, n in zip(rows, room, strict=True)]
        offers = propose_every([r.lookup for r in rows], asks)  # a model's rows together
    lengths = [min(len(d.tokens), n) for d, n in zip(offers, room, strict=True)]
    best = _best_length(rows, lengths, stats)
    out = []
    for d, n, row in zip(offers, lengths, rows, strict=True):
        kept = d.cut(min(best, n))
        if not kept.tokens:
            row.drafting.skip()
        out.append(kept)
    return out


def _known(row: Seq) -> int:
    """The tokens a row feeds before its drafts: its newest and those fed again."""
    return max(1, len(row.feed))


def _offered(rows: list[Seq], *, every: bool = False) -> list[int]:
    """The most tokens each row could draft: what its known tokens leave of the step's
    length (0: it does not draft, or not yet: a draft model's caches catching up;
    `every`: as if they had)."""
    top = min(VERIFY_LENGTH, max(VERIFY_ROWS // max(1, len(rows)), 1))
    return [max(0, top - _known(r)) if r.lookup is not None and (every or r.lookup.ready) else 0
            for r in rows]  # fmt: skip


def _ask(row: Seq, length: int) -> int:
    """The tokens to ask a row's drafter for: a draft model `length` (its tokens cost),
    prompt lookup all it may use (a longer search costs nothing more)."""
    if row.lookup is None:
        return 0
    room = _room(row)
    return min(room, length) if row.lookup.costly else room


def _best_length(rows: list[Seq], offered: list[int], stats: SpecStats) -> int:
    """The draft length that yields most tokens per unit of step cost, when each row
    offers `offered` tokens (0: no draft); 0 where none beats the step without drafts
    (a plain one, or a verify step feeding known tokens again)."""
    beta = stats.beta(len(rows))
    known = [_known(r) for r in rows]
    # a draft model's rows pay for each token they draft (its forwards)
    per_token = stats.draft_cost()
    costly = [n if r.lookup is not None and r.lookup.costly else 0
              for r, n in zip(rows, offered, strict=True)]  # fmt: skip
    longest = max(known, default=1)
    base = 1.0 if longest == 1 else 1.0 + stats.sync + beta * (longest - 1)
    best, value = 0, len(rows) / base  # a token a row
    for k in range(1, max(offered, default=0) + 1):
        gain = sum(
            row.drafting.expected(min(k, n)) if n else 1.0
            for row, n in zip(rows, offered, strict=True)
        )
        length = max(m + min(k, n) for m, n in zip(known, offered, strict=True))
        drafting = per_token * sum(min(k, n) for n in costly)
        worth = gain / (1.0 + stats.sync + beta * (length - 1) + drafting)
        if worth > value * 1.02:
            best, value = k, worth
    return best


def _room(row: Seq) -> int:
    """Drafted tokens the row may still use: its max_tokens bounds them."""
    left = row.out.max_tokens - len(row.out.progress.generated) - 1
    return max(0, min(MAX_DRAFT, left))


def verify_step(
    batch: RunningBatch, stats: SpecStats, plain: float, agree: Agree
) -> tuple[list[int], int]:
    """One synchronous step with drafts (module docstring): the rows that ended, and
    the tokens each row fed (0: the step only read rows back, some of which ended).
    Its cost from its forward on, against `plain` seconds a plain step takes, goes into
    the measure of beta."""
    rows = batch.rows
    caches = batch.caches
    assert caches is not None
    ended = []
    for i, row in enumerate(rows):
        if row.unread is not None:
            if row.read():
                ended.append(i)
                continue
            row.feed = [row.out.progress.generated[-1]]
        elif row.read():  # cancelled
            ended.append(i)
        elif not row.feed:  # joined without a first step: its prompt's last token
            assert row.input is not None
            row.feed = [int(t) for t in row.input.tolist()]  # type: ignore[union-attr, arg-type]
    if ended:
        return ended, 0  # they leave first: no columns are written for them
    began = time.perf_counter()  # after the reads: a pipelined step's wait is not ours
    stats.plain = plain
    spent = stats.draft.spent
    drafts = plan_drafts(rows, stats)
    drafting = stats.draft.spent - spent  # a draft model's forwards: not the verify's cost
    nothing = all(len(r.feed) == 1 and not d.tokens for r, d in zip(rows, drafts, strict=True))
    if nothing and not _hands_hidden(rows):
        # nothing to check after all: a plain step, pipelined again from here
        for row in rows:
            row.input = mx.array(row.feed, dtype=mx.int32)
        return batch.decode(None, 0, agree), 1
    inputs = [row.feed + list(d.tokens) for row, d in zip(rows, drafts, strict=True)]
    length = max(len(x) for x in inputs)
    padded = [x + [x[-1]] * (length - len(x)) for x in inputs]
    # each row's position of its first fed token (its tokens so far end with the feed)
    starts = [len(r.lookup) - len(r.feed) if r.lookup is not None else 0 for r in rows]
    caches.keep_steps()  # recurrent layers: the states `rewind` goes back to
    hidden = batch.model.forward(mx.array(padded, dtype=mx.int32), caches.layers)
    # logits only where a row samples: from its last known token through its drafts
    at = [i * length + p for i, row in enumerate(rows)
          for p in range(len(row.feed) - 1, len(inputs[i]))]  # fmt: skip
    flat = hidden.reshape(-1, hidden.shape[-1])[mx.array(at, dtype=mx.int32)]
    logits = batch.model.logits(flat)
    # plain greedy rows without a grammar read every position's argmax at once
    fast = [r.sampler.plain_greedy and r.matcher is None for r in rows]
    best = mx.argmax(logits, axis=-1) if any(fast) else None
    mx.eval(logits if best is None else [logits, best])
    top: list[int] = [] if best is None else best.tolist()  # type: ignore[assignment]
    kept, cursor = [], 0
    for i, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
        known = len(row.feed)
        span = slice(cursor, cursor + 1 + len(draft.tokens))
        cursor += 1 + len(draft.tokens)
        if fast[i]:
            done, matched, accepted, token = _check_greedy(row, draft, top[span])
        elif draft.q is not None and draft.key is not None:  # drawn from a distribution
            params = row.sampler.params
            drawn = checked_tokens(logits[span], draft.tokens, draft.q, draft.key, params)
            done, matched, accepted, token = _check_greedy(row, draft, drawn)
        else:
            done, matched, accepted, token = _check(row, draft, logits[span])
        kept.append(known + matched)  # columns holding accepted tokens
        _count(row, draft, accepted, stats)
        if done:
            ended.append(i)
        row.feed = [*inputs[i][: kept[-1]], token]
    # every row commits as many columns as the row that kept fewest; the others feed
    # their accepted tokens again (a row that ended keeps only its accepted columns)
    commit = min(kept)
    caches.rewind(length - commit)
    observe_committed(rows, starts, hidden, commit)
    for row in rows:
        row.feed = row.feed[commit:]
        row.input = mx.array(row.feed[-1:], dtype=mx.int32)
    stats.steps += 1
    stats.measured(len(rows), length, time.perf_counter() - began - drafting, plain)
    return ended, length


def _check(row: Seq, draft: Draft, logits: mx.array) -> tuple[bool, int, int, int]:
    """Sample `row`'s positions in order while they agree with `draft`: (ended, drafted
    tokens kept in the caches, drafted tokens accepted, the last token sampled: the
    row's next input)."""
    for j in range(len(draft.tokens) + 1):  # j drafted tokens matched so far
        mask = row.matcher.mask() if row.matcher is not None else None
        sampled = read_sampled(row.sampler.sample(logits[j : j + 1], mask))
        hit = j < len(draft.tokens) and sampled.token_id == draft.tokens[j]
        if row.take(sampled):  # its last token (accepted, if drafted, but never fed)
            return True, j, j + hit, sampled.token_id
        if not hit:
            return False, j, j, sampled.token_id
    raise AssertionError("unreachable: the last position never matches a draft")


def _check_greedy(row: Seq, draft: Draft, best: list[int]) -> tuple[bool, int, int, int]:
    """`_check` for tokens chosen at once: a plain greedy row's (Sampler.plain_greedy:
    the positions' argmax), or those rejection sampling kept (runtime/batch/rejection.py:
    the drafted tokens accepted, then one that differs from the draft there)."""
    for j, token in enumerate(best):
        hit = j < len(draft.tokens) and token == draft.tokens[j]
        if row.take(SampledToken(token, None, ())):
            return True, j, j + hit, token
        if not hit:
            return False, j, j, token
    raise AssertionError("unreachable: the last position never matches a draft")


def _count(row: Seq, draft: Draft, matched: int, stats: SpecStats) -> None:
    if not draft.tokens:
        return
    row.drafting.observe(len(draft.tokens), matched)
    row.drafts.drafted += len(draft.tokens)
    row.drafts.accepted += matched
    stats.drafted += len(draft.tokens)
    stats.accepted += matched
