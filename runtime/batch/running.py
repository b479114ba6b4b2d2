"""The running batch: the sequences decoding together, their caches, and one decode step.

Where the model's caches batch (runtime/cache/batch.py), the rows' caches are joined in
one `BatchCaches` and a step is a single forward over every row's last token; otherwise
each row keeps caches of its own and steps alone. A step's forward is queued on the
device before the previous step's tokens are read back (`decode`), so detokenizing,
stop strings and grammar masks run on the host while the device computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from runtime.batch.generate import CausalLM, sample_arrays
from runtime.batch.prompt_prefill import PromptPrefill
from runtime.batch.sequence import Seq
from runtime.cache import BatchCaches, RaggedCache
from runtime.models.base import rows_layout
from runtime.prefix import RowState
from runtime.vision.spans import decode_forward

# Every row in the list sampled its next token (`unread`, not yet read); a lockstep
# group replaces it with rank 0's (Scheduler._agree)
Agree = Callable[[list[Seq]], None]


class RunningBatch:
    """The rows decoding together (see the module docstring)."""

    def __init__(
        self, model: CausalLM, make_caches: Callable[[], list[Any]], *, batched: bool
    ) -> None:
        self.model = model
        self.batched = batched  # the rows share one BatchCaches
        self._make = make_caches
        self.rows: list[Seq] = []
        self.caches: BatchCaches | None = None
        self.row_bytes = (0, 0)  # (per token, per row) as measured on the batch
        self.padded_bytes = 0  # of row_bytes' per token, in layers whose rows pad
        # full-attention rows in buffers of their own (runtime/cache/rows.py), not padded
        self.own_rows = batched and rows_layout(model, make_caches())

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return self.caches.nbytes if self.caches is not None else 0

    def longest(self) -> int:
        """The longest row's tokens so far (prompt and output)."""
        return max((len(r.out.progress.prompt) + len(r.out.progress.generated)
                    for r in self.rows), default=0)  # fmt: skip

    def projected(self, joining: Seq | None = None) -> int:
        """The batch caches' bytes, every row (and `joining`) at its longest (prompt +
        max_tokens): its own length in layers that keep rows apart, the longest row's
        in those that pad."""
        rows = self.rows if joining is None else [*self.rows, joining]
        per_token, per_row = self.row_bytes
        if not rows:
            return 0
        lengths = [len(r.out.progress.prompt) + r.out.max_tokens for r in rows]
        padded = self.padded_bytes if self.own_rows else per_token
        own = (per_token - padded) * sum(lengths)
        return own + len(rows) * (max(lengths) * padded + per_row)

    def fits(self, seq: Seq, budget: int) -> bool:
        """Whether the caches, with `seq` joined and every row at its longest, stay
        within `budget` bytes (0: no bound; the trie gives way to them). Alone, a
        sequence always runs: the context length bounds it."""
        if not self.rows or not budget or not self.row_bytes[0]:
            return True
        return self.projected(seq) <= budget

    def clear(self) -> None:
        self.rows, self.caches = [], None

    def join(self, seq: Seq, caches: list[Any], *, own: bool = False) -> None:
        """Add `seq`, its prompt read into `caches` (the trie's live ones); `own`: no one
        else keeps them, so rows in buffers of their own take their buffers (else copies;
        layers that pad copy anyway)."""
        if self.batched:
            if self.caches is None:
                self.caches = BatchCaches(caches, rows=self.own_rows)
            self.caches.add(caches, copy=not own)
            self.row_bytes = self.caches.bytes_per_token()
            self.padded_bytes = self.caches.padded_bytes_per_token()
        else:
            seq.caches = _copy(caches, self._make())
        self.rows.append(seq)

    def leave(self, ended: list[int]) -> list[tuple[list[Any], Seq]]:
        """Take the rows at `ended` out; each with its caches (for the trie)."""
        out = []
        for i in ended:
            row = self.rows[i]
            caches = self.caches.row(i) if self.caches is not None else row.caches
            assert caches is not None
            out.append((caches, row))
        if self.caches is not None:
            self.caches.remove(ended)
        self.rows = [r for i, r in enumerate(self.rows) if i not in set(ended)]
        if not self.rows:
            self.caches = None
        return out

    def views(self, seq: Seq) -> RowState | None:
        """`seq`'s keys and values in every layer, when it is a row of the batch."""
        i = next((i for i, r in enumerate(self.rows) if r is seq), None)
        if i is not None and self.caches is not None:
            return self.caches.views(i)
        return None

    def decode(self, rider: PromptPrefill | None, chunk: int, agree: Agree) -> list[int]:
        """One decode step: queue its forward (with a `rider`'s next `chunk` prompt
        tokens), read the previous step's tokens, sample the next; the rows that ended."""
        logits = self.forward(rider, chunk)
        mx.async_eval(logits)
        ended = [i for i, row in enumerate(self.rows) if row.read()]
        arrays: list[mx.array] = []
        kept = [row for i, row in enumerate(self.rows) if i not in ended]
        for i, row in enumerate(self.rows):
            if i in ended:
                continue
            mask = row.matcher.mask() if row.matcher is not None else None
            row.unread = row.sampler.sample(logits[i], mask)
        agree(kept)
        for row in kept:
            assert row.unread is not None
            row.input = row.unread.token
            arrays += sample_arrays(row.unread)
        if chunk and rider is not None:
            arrays += [a for c in rider.caches for a in c.state]
        mx.async_eval(arrays)
        return ended

    def forward(self, rider: PromptPrefill | None = None, chunk: int = 0) -> list[mx.array]:
        """Queue one step's logits for every row: one (1, V) array per row; with a
        `rider`, its next `chunk` prompt tokens go through the same forward."""
        inputs = [r.input for r in self.rows]
        assert all(i is not None for i in inputs)
        if rider is not None and chunk and self.caches is not None:
            prompt = mx.array(rider.rest[:chunk], dtype=mx.int32)
            tokens = mx.concatenate([*inputs, prompt]).reshape(1, -1)  # type: ignore[list-item]
            layers = zip(self.caches.layers, rider.caches, strict=True)
            hidden = self.model.forward(tokens, [RaggedCache(b, p) for b, p in layers])
            logits = self.model.logits(hidden[0, : len(self.rows)])
            return [logits[i : i + 1] for i in range(len(self.rows))]
        if self.caches is not None:
            tokens = mx.concatenate(inputs).reshape(-1, 1)  # type: ignore[arg-type]
            shifts = [r.shift for r in self.rows]
            hidden = decode_forward(self.model, tokens, self.caches.layers, shifts)
            logits = self.model.logits(hidden[:, -1, :])
            return [logits[i : i + 1] for i in range(len(self.rows))]
        out = []
        for row in self.rows:
            assert row.input is not None and row.caches is not None
            hidden = decode_forward(self.model, row.input.reshape(1, 1), row.caches, [row.shift])
            out.append(self.model.logits(hidden[:, -1, :]))
        return out

    def first_alone(self, seq: Seq, caches: list[Any], agree: Agree) -> mx.array:
        """`seq`'s first decode step, in a forward of its own (before it joins); the
        prompt's last token's hidden state, (1, D) (an MTP head reads it)."""
        assert seq.input is not None
        hidden = decode_forward(self.model, seq.input.reshape(1, 1), caches, [seq.shift])
        mask = seq.matcher.mask() if seq.matcher is not None else None
        seq.unread = seq.sampler.sample(self.model.logits(hidden[:, -1, :]), mask)
        agree([seq])
        seq.input = seq.unread.token
        mx.eval([hidden, *sample_arrays(seq.unread), *[a for c in caches for a in c.state]])
        assert seq.prefill is not None
        seq.prefill.offset += 1
        return hidden[0]


def _copy(caches: Sequence[Any], fresh: list[Any]) -> list[Any]:
    """Copies of `caches` (through their own snapshots), for a row that decodes alone."""
    for src, dst in zip(caches, fresh, strict=True):
        if src.offset and not dst.restore(src.snapshot(0), src.offset):
            raise RuntimeError(f"{type(src).__name__} could not be copied")
    return fresh
