"""The scheduler's dealings with the prefix trie (runtime/prefix/cache.py): a prompt's
lease on the trie's one live path (begin, snapshots where the prefill pauses, end), and
finished rows' caches on their way back into the trie (`keep`, then `write_back`
between prefills, when the live caches are free).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from runtime.batch.generate import CausalLM
from runtime.batch.prompt_prefill import PromptPrefill
from runtime.batch.sequence import Seq
from runtime.cache import KVCache, QuantizedKVCache, RowView
from runtime.prefix import Key, Lease, PrefixCache, RowState
from runtime.vision.spans import PromptImages


class TrieLink:
    """One scheduler's side of the trie; `changed` is set whenever the trie changed."""

    def __init__(
        self,
        prefix: PrefixCache[Any],
        model: CausalLM,
        on_begin: Callable[[Lease[Any]], None],
    ) -> None:
        self.prefix = prefix
        self._model = model
        self._on_begin = on_begin  # the runner logs the lease's cache report
        # finished rows' caches and tokens, for the trie (the row: a loan's source)
        self.writebacks: deque[tuple[list[Any], tuple[Key, ...], Seq]] = deque()
        self.changed = False

    def begin(self, seq: Seq, keeps_inside: bool | None) -> None:
        """Lease the live path for `seq`'s prompt (its longest cached prefix restored)."""
        self.write_back()  # the trie's live caches are free only between prefills
        req = seq.request
        seq.images = PromptImages.of(self._model, req.images, req.prompt_tokens)
        keys, points = req.prompt_tokens, req.boundaries
        if seq.images is not None:  # keyed by content; restore points after each image
            keys = seq.images.keys(keys)
            points = seq.images.restore_points(points)
        lease = self.prefix.begin(keys, pin=req.pin, boundaries=points)
        self._on_begin(lease)
        seq.out.progress.reused = lease.reused
        seq.out.progress.cache = lease.report
        seq.prefill = PromptPrefill(lease, req.prompt_tokens, seq.images, keeps_inside)
        self.changed = True

    def pause(self, seq: Seq, at: int) -> None:
        """The prefill reached a snapshot point at offset `at`."""
        assert seq.prefill is not None
        self.prefix.snapshot_at(seq.prefill.lease, at)

    def end(self, seq: Seq) -> None:
        """Record the prompt read so far in the trie and give its live caches back."""
        assert seq.prefill is not None
        held = seq.prefill.offset
        self.prefix.end(seq.prefill.lease, seq.prefill.lease.tokens[:held])
        seq.prefill = None
        self.changed = True

    def keep(self, caches: list[Any], row: Seq) -> None:
        """A finished row's caches go back to the trie at the next `write_back`."""
        held = caches[0].offset
        tokens = (row.out.progress.prompt + tuple(row.out.progress.generated))[:held]
        keys = tokens if row.images is None else row.images.keys(tokens)
        self.writebacks.append((caches, keys, row))

    def write_back(self) -> None:
        while self.writebacks:
            caches, tokens, _ = self.writebacks.popleft()
            if tokens:
                self.prefix.adopt(tokens, caches)
                self.changed = True

    def kept_state(self, seq: Seq) -> RowState | None:
        """A finished row's keys and values while its caches wait to go back (None:
        not waiting, or caches that are not KV caches, plain or quantized)."""
        for caches, _, row in self.writebacks:
            if row is seq:
                views = [_held(c) for c in caches]
                return None if any(v is None for v in views) else views  # type: ignore[return-value]
        return None


def _held(cache: object) -> RowView | None:
    """A KV cache's held keys and values (views); None for another kind, or empty."""
    if isinstance(cache, QuantizedKVCache):
        return cache.held()
    if isinstance(cache, KVCache) and cache.keys is not None and cache.values is not None:
        n = cache.offset
        return cache.keys[..., :n, :], cache.values[..., :n, :]
    return None
