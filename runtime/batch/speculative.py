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
the rejected columns are rewound, so the prefix trie only ever sees accepted tokens.

Steps are synchronous (a row's draft needs its newest token on the host); the batch goes
back to pipelined decode (runtime/batch/running.py) as soon as no row drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from runtime.batch.drafts import MAX_DRAFT, SPECULATIVE_MODES, Draft, Lookup
from runtime.batch.generate import SampledToken, read_sampled
from runtime.batch.history import SharedHistory
from runtime.batch.running import Agree, RunningBatch
from runtime.batch.sequence import Seq
from runtime.types import GenerationRequest

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
    measure: bool = True  # False: the ratio holds (tests pin the cost model)
    # a verify step is synchronous: the host's work no longer overlaps the forward
    sync: float = 0.08

    def beta(self, rows: int) -> float:
        return rows * self.ratio / (1.0 + rows * self.ratio)

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

    def drafts(self, request: GenerationRequest) -> bool:
        """Whether a request's sequence drafts: as it says, else when it has a predicted
        output, else as the server's setting."""
        if not self.allowed:
            return False
        if request.speculative is not None:
            return request.speculative
        return self.enabled or bool(request.prediction)

    def start(self, seq: Seq) -> None:
        """Drafting state for a sequence joining the batch: its prompt and output so
        far, and its prediction."""
        p = seq.out.progress
        seq.lookup = Lookup(
            p.prompt + tuple(p.generated), seq.request.prediction, len(p.prompt), self.history
        )

    def finished(self, seq: Seq) -> None:
        """A sequence left the batch: what it wrote is there for others to draft from."""
        if self.history is not None and seq.lookup is not None:
            self.history.add(seq.lookup.tokens)

    def step(self, batch: RunningBatch, plain: float, agree: Agree) -> list[int]:
        """A verify step (`verify_step`); `plain`: a plain step's seconds."""
        return verify_step(batch, self.stats, plain, agree)[0]

    def plan(self, batch: RunningBatch) -> None:
        """Decide whether the next step verifies; when the batch goes back to pipelined
        steps, rows forget the tokens a verify step would feed."""
        before = self.verifying
        self.verifying = (
            bool(batch.rows) and can_speculate(batch) and wants_drafts(batch, self.stats)
        )
        if before and not self.verifying:
            for row in batch.rows:
                row.feed = []


def can_speculate(batch: RunningBatch) -> bool:
    """Whether the batch's rows can verify drafts: batched, rewindable caches (token
    caches; recurrent layers cannot go back), text positions (no image rope shift)."""
    caches = batch.caches
    return caches is not None and caches.rewindable and all(r.shift == 0 for r in batch.rows)


def wants_drafts(batch: RunningBatch, stats: SpecStats) -> bool:
    """Whether the next step should be a verify step: some row has known tokens to feed
    again, or drafts worth checking (after a pipelined step, judged without the token
    still on its way: a match at the sequence's end is what makes one likely)."""
    if any(len(row.feed) > 1 for row in batch.rows):
        return True
    return any(d.tokens for d in plan_drafts(batch.rows, stats))


def plan_drafts(rows: list[Seq], stats: SpecStats) -> list[Draft]:
    """Each row's draft for one step, the batch's draft length chosen together: every
    row pads to the longest, so a length is worth what all rows expect to gain from it
    (a row without a draft gains nothing) against what the step costs, and nothing is
    drafted where no length beats a plain step. Within the budget of rows x L tokens.
    The rows' texts are searched only where drafts of every length offered could pay."""
    known = max(len(row.feed) for row in rows) if rows else 1
    top = min(VERIFY_LENGTH, max(VERIFY_ROWS // max(1, len(rows)), 1)) - known
    offers = [Draft()] * len(rows)
    if _best_length(rows, [top if r.lookup is not None else 0 for r in rows], known, stats):
        offers = [r.lookup.propose(_room(r)) if r.lookup is not None else Draft() for r in rows]
    best = _best_length(rows, [len(d.tokens) for d in offers], known, stats)
    out = []
    for row, d in zip(rows, offers, strict=True):
        kept = Draft(d.tokens[:best], d.predicted)
        if not kept.tokens:
            row.drafting.skip()
        out.append(kept)
    return out


def _best_length(rows: list[Seq], offered: list[int], known: int, stats: SpecStats) -> int:
    """The draft length that yields most tokens per unit of step cost, when each row
    offers `offered` tokens (0: no draft); 0 where none beats a plain step."""
    top = min(VERIFY_LENGTH, max(VERIFY_ROWS // max(1, len(rows)), 1)) - known
    beta = stats.beta(len(rows))
    best, value = 0, float(len(rows))  # a plain step: a token a row, at cost 1
    for k in range(1, max(0, min(top, max(offered, default=0))) + 1):
        gain = sum(
            row.drafting.expected(min(k, n)) if n else 1.0
            for row, n in zip(rows, offered, strict=True)
        )
        worth = gain / (1.0 + stats.sync + beta * (known - 1 + k))
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
    drafts = plan_drafts(rows, stats)
    if all(len(r.feed) == 1 and not d.tokens for r, d in zip(rows, drafts, strict=True)):
        # nothing to check after all: a plain step, pipelined again from here
        for row in rows:
            row.input = mx.array(row.feed, dtype=mx.int32)
        return batch.decode(None, 0, agree), 1
    inputs = [row.feed + list(d.tokens) for row, d in zip(rows, drafts, strict=True)]
    length = max(len(x) for x in inputs)
    padded = [x + [x[-1]] * (length - len(x)) for x in inputs]
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
    for row in rows:
        row.feed = row.feed[commit:]
        row.input = mx.array(row.feed[-1:], dtype=mx.int32)
    stats.steps += 1
    stats.measured(len(rows), length, time.perf_counter() - began, plain)
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
    """`_check` for a plain greedy row (Sampler.plain_greedy): its tokens are the
    positions' argmax, read at once."""
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
