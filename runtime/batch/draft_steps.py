"""A draft model's drafted positions for the rows that draft in one verify step.

Each row has fed the tokens its caches lacked: the logits there give its first drafted
token. Each later position is a forward over the token drafted before it: one (B, 1)
forward for all the rows where their caches batch without a copy (`batches`: every
layer a plain KV cache, which a `BatchCaches` of row buffers joins as views, runtime/
cache/rows.py), reading the draft's weights once a position instead of once a row and
position; else one forward a row and position. A row leaves the batch once it drafted
its tokens (leaving copies nothing either).

The batch is dropped afterwards. It wrote the drafted positions' keys and values into
the rows' buffers past each row's own cache's end, which stays where the row's fed
tokens end: where its next draft starts anyway (drafted tokens are never kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from runtime.batch.generate import CausalLM
from runtime.cache import BatchCaches, KVCache
from runtime.models.base import rows_layout

# (the row's index, its logits (1, V)) -> the token drafted there, (1,), and the
# distribution it was drawn from, (1, V) (None: the argmax)
Pick = Callable[[int, mx.array], tuple[mx.array, mx.array | None]]


def batches(model: Any, caches: Sequence[object]) -> bool:
    """Whether rows of `model` over caches like `caches` draft together: every layer a
    plain KV cache, kept in row buffers (runtime/models/base.py `rows_layout`)."""
    return all(type(c) is KVCache for c in caches) and rows_layout(model, caches)


def draft_positions(
    model: CausalLM,
    caches: Sequence[list[Any]],
    first: Sequence[mx.array],
    counts: Sequence[int],
    pick: Pick,
    *,
    together: bool,
) -> list[tuple[list[mx.array], list[mx.array]]]:
    """Each row's `counts[i]` drafted tokens ((1,) arrays) and the distributions they were
    drawn from (none for argmax rows), lazy; `first`: each row's logits after its fed
    tokens; `together`: the rows' caches `batches`."""
    tokens: list[list[mx.array]] = [[] for _ in caches]
    qs: list[list[mx.array]] = [[] for _ in caches]

    def take(i: int, logits: mx.array) -> None:
        token, q = pick(i, logits)
        tokens[i].append(token)
        if q is not None:
            qs[i].append(q)

    for i, logits in enumerate(first):
        take(i, logits)
    if together and len(caches) > 1:
        _together(model, caches, counts, tokens, take)
    else:
        for i, own in enumerate(caches):
            for _ in range(1, counts[i]):
                hidden = model.forward(tokens[i][-1].reshape(1, 1), own)
                take(i, model.logits(hidden[:, -1, :]))
    return list(zip(tokens, qs, strict=True))


def _together(
    model: CausalLM,
    caches: Sequence[list[Any]],
    counts: Sequence[int],
    tokens: list[list[mx.array]],
    take: Callable[[int, mx.array], None],
) -> None:
    """The rows' later positions, one (B, 1) forward each (module docstring)."""
    batch = BatchCaches(caches[0], rows=True)
    for own in caches:
        batch.add(own)  # views of the row's buffers (evaluates what it fed)
    rows = list(range(len(caches)))
    for j in range(1, max(counts)):
        done = [b for b, i in enumerate(rows) if counts[i] <= j]
        if done:
            batch.remove(done)
            rows = [i for b, i in enumerate(rows) if b not in done]
        x = mx.concatenate([tokens[i][-1] for i in rows]).reshape(len(rows), 1)
        hidden = model.forward(x, batch.layers)
        logits = model.logits(hidden[:, -1, :])
        for b, i in enumerate(rows):
            take(i, logits[b : b + 1])
