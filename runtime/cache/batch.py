"""Per-layer caches of several sequences joined into one, for a batched decode step.

A running batch decodes one token for every sequence in one forward. Each layer's cache
is a `BatchCache` made from the sequences' own caches (their rows) when they join and
cut back into per-sequence caches when they leave, for the prefix trie.

- Token-indexed caches (KV, latent, sliding window) share one buffer, left-padded so the
  newest token of every row sits in the same column: one write per step for the whole
  batch. `offset` is then a (B,) array of each row's position (rotary embeddings take
  per-row offsets) and `make_mask` hides each row's padding (and what lies outside a
  sliding window; a windowed row keeps its older tokens until it leaves, then only the
  window goes back).
- Recurrent caches stack their fixed-size states along the batch axis
  (runtime/cache/batch_recurrent.py).
- Quantized KV caches (runtime/cache/quantized.py) batch each of their three parts
  (codes, scales, biases) as a token cache of its own.

Joining or leaving copies the buffers once; steps in between write in place. With
`rows`, full-attention layers (plain or quantized) keep each row in buffers of its own
instead (runtime/cache/rows.py): no padding, no copies to join or leave; the CPU
kernels read them there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import mlx.core as mx

from runtime.cache.batch_recurrent import BatchRecurrentCache
from runtime.cache.kv import KVCache
from runtime.cache.mask import Mask
from runtime.cache.quantized import Quantized, QuantizedKVCache, append
from runtime.cache.recurrent import RecurrentCache
from runtime.cache.rotating import RotatingKVCache, RotatingSnapshot
from runtime.cache.rows import BatchQuantizedRows, RowTokenCache

_STEP = 256  # spare columns added at a time

RowCache: TypeAlias = KVCache | RotatingKVCache | RecurrentCache | QuantizedKVCache
# a row's keys and values in one layer, oldest first: arrays, or a quantized cache's groups
RowView: TypeAlias = tuple[mx.array, mx.array] | tuple[Quantized, Quantized]


def batchable(caches: Sequence[object]) -> bool:
    """Whether every layer's cache is of a kind `BatchCache` can join."""
    kinds = (KVCache, RotatingKVCache, RecurrentCache, QuantizedKVCache)
    return all(isinstance(c, kinds) for c in caches)


def _temporal(cache: KVCache | RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A token cache's held keys and values, oldest first (held may be < offset)."""
    if isinstance(cache, KVCache):
        assert cache.keys is not None and cache.values is not None
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    snap = cache.snapshot(0)
    assert isinstance(snap, RotatingSnapshot)
    return snap.keys, snap.values


class BatchTokenCache:
    """Rows of token-indexed caches in one left-padded buffer (see the module docstring).

    `template` is one row's cache: rows leave as fresh caches of its kind.
    """

    def __init__(self, template: KVCache | RotatingKVCache) -> None:
        self._kind = type(template)
        self._window = template.max_size if isinstance(template, RotatingKVCache) else None
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._cols = 0  # buffer columns in use
        self._left: list[int] = []  # padding columns at the start of each row
        self._pos: list[int] = []  # each row's offset (tokens seen)

    @property
    def rows(self) -> int:
        return len(self._pos)

    @property
    def plain(self) -> bool:
        """Rows of full-attention caches: every token kept (no window)."""
        return self._window is None

    @property
    def padding(self) -> list[int]:
        """Each row's padding columns, before its first token."""
        return list(self._left)

    def token_bytes(self) -> int:
        """Bytes a row's token takes in the buffers."""
        if self.keys is None or self.values is None:
            return 0
        b, _, cols, _ = self.keys.shape
        return int(self.keys.nbytes + self.values.nbytes) // max(1, b * cols)

    @property
    def offset(self) -> mx.array:
        """Each row's position, (B,): rotary embeddings rotate every row by its own."""
        return mx.array(self._pos, dtype=mx.int32)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state)

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        """(B, 1, L, K): a row's queries see its own tokens (not its padding), causally,
        within the sliding window if this layer has one."""
        window = self.window_of(window)
        total = self._cols + length
        if length == 1 and not any(self._left) and (window is None or total <= window):
            return None  # no padding, nothing out of the window: every key is seen
        k_col = mx.arange(total)[None, None, None, :]
        q_col = mx.arange(self._cols, total)[None, None, :, None]
        left = mx.array(self._left, dtype=mx.int32)[:, None, None, None]
        allowed = (k_col >= left) & (k_col <= q_col)
        if window is not None:
            allowed = allowed & (q_col - k_col < window)
        return allowed

    def window_of(self, window: int | None = None) -> int | None:
        """The sliding window these rows' queries see through: the cache's own, else the
        layer's (`window`), else None."""
        return self._window if self._window is not None else window

    def window_binds(self, length: int, window: int | None = None) -> bool:
        """Whether a block of `length` queries has keys out of its window in some row
        (past the row's padding): `make_mask` would hide them."""
        window = self.window_of(window)
        total = self._cols + length
        return window is not None and any(total - window > left for left in self._left)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (B, H, L, D) keys/values, one row each; return every column in use."""
        length = keys.shape[2]
        assert self.keys is not None and self.values is not None
        end = self._cols + length
        if end > self.keys.shape[2]:
            self._widen(end - self.keys.shape[2] + _STEP)
        self.keys[..., self._cols : end, :] = keys
        self.values[..., self._cols : end, :] = values
        self._cols = end
        self._pos = [p + length for p in self._pos]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def rewind(self, n: int) -> None:
        """Forget every row's last `n` tokens (a speculative step's rejected columns):
        the next write lands where they were."""
        if not 0 <= n <= self._cols - max(self._left, default=0):
            raise ValueError(f"cannot rewind {n} of {self._cols} columns")
        self._cols -= n
        self._pos = [p - n for p in self._pos]

    def _widen(self, extra: int) -> None:
        assert self.keys is not None and self.values is not None
        b, h, _, dk = self.keys.shape
        self.keys = mx.concatenate(
            [self.keys, mx.zeros((b, h, extra, dk), dtype=self.keys.dtype)], axis=2
        )
        self.values = mx.concatenate(
            [self.values, mx.zeros((b, h, extra, self.values.shape[-1]), self.values.dtype)],
            axis=2,
        )

    def add(self, cache: KVCache | RotatingKVCache) -> None:
        """Join a row at the end of the batch (its arrays are copied in). The first row
        of a plain KV cache lends its buffers instead: the batch writes its next tokens
        in place there once the row's own cache lets go of them (the prefix trie lends
        its live state, runtime/prefix/cache.py), so a long prompt's keys and values are
        not held twice."""
        if self.keys is None and _plain(cache):
            assert cache.keys is not None and cache.values is not None
            # new array objects on the same buffers: writing through one (in place only
            # once the other lets go, else a copy) never changes what the other sees
            self.keys, self.values = mx.array(cache.keys), mx.array(cache.values)
            self._cols, self._left, self._pos = cache.offset, [0], [cache.offset]
            return
        k, v = _temporal(cache)
        held = k.shape[2]
        if self.keys is None or self.values is None:
            self.keys, self.values = k, v
            self._cols, self._left, self._pos = held, [0], [cache.offset]
            self._widen(_STEP)
            return
        if held > self._cols:  # the new row is longer: pad every old row further
            shift = held - self._cols
            self.keys = _pad_left(self.keys[..., : self._cols, :], shift)
            self.values = _pad_left(self.values[..., : self._cols, :], shift)
            self._left = [n + shift for n in self._left]
            self._cols = held
        else:
            self.keys = self.keys[..., : self._cols, :]
            self.values = self.values[..., : self._cols, :]
        pad = self._cols - held
        self.keys = mx.concatenate([self.keys, _pad_left(k, pad)], axis=0)
        self.values = mx.concatenate([self.values, _pad_left(v, pad)], axis=0)
        self._left.append(pad)
        self._pos.append(cache.offset)
        self._widen(_STEP)

    def remove(self, rows: Sequence[int]) -> None:
        """Drop rows; the columns no remaining row uses are cut off."""
        keep = [i for i in range(self.rows) if i not in set(rows)]
        if not keep:
            self.keys = self.values = None
            self._cols, self._left, self._pos = 0, [], []
            return
        assert self.keys is not None and self.values is not None
        index = mx.array(keep, dtype=mx.int32)
        cut = min(self._left[i] for i in keep)
        self.keys = mx.take(self.keys, index, axis=0)[:, :, cut : self._cols, :]
        self.values = mx.take(self.values, index, axis=0)[:, :, cut : self._cols, :]
        self._left = [self._left[i] - cut for i in keep]
        self._pos = [self._pos[i] for i in keep]
        self._cols -= cut
        self._widen(_STEP)

    def view(self, i: int) -> tuple[mx.array, mx.array]:
        """Row `i`'s keys and values, oldest first, without a copy."""
        assert self.keys is not None and self.values is not None
        left = self._left[i]
        return self.keys[i : i + 1, :, left : self._cols, :], self.values[
            i : i + 1, :, left : self._cols, :
        ]

    def row(self, i: int) -> KVCache | RotatingKVCache:
        """Row `i` as a cache of its own, holding the row's tokens: a copy, except that
        the only row of plain KV caches gets the buffers themselves (the batch drops the
        row next, runtime/batch/scheduler.py)."""
        assert self.keys is not None and self.values is not None
        if (
            self.rows == 1
            and self._window is None
            and self._left == [0]
            and self._pos == [self._cols]
        ):
            own = self._kind()  # type: ignore[call-arg]  # a KVCache kind here
            assert isinstance(own, KVCache)
            own.hold(mx.array(self.keys), mx.array(self.values), self._cols)
            return own
        k = self.keys[i : i + 1, :, self._left[i] : self._cols, :]
        v = self.values[i : i + 1, :, self._left[i] : self._cols, :]
        if self._window is not None:
            held = min(k.shape[2], self._window)
            k, v = k[..., k.shape[2] - held :, :], v[..., v.shape[2] - held :, :]
            out = RotatingKVCache(max_size=self._window)
            snap = RotatingSnapshot(mx.contiguous(k), mx.contiguous(v), self._pos[i], self._window)
            if not out.restore(snap, self._pos[i]):
                raise RuntimeError("a sliding-window row could not be rebuilt")
            return out
        fresh = self._kind()  # type: ignore[call-arg]  # a KVCache kind here
        assert isinstance(fresh, KVCache)
        fresh.update_and_fetch(mx.contiguous(k), mx.contiguous(v))
        return fresh


def _plain(cache: object) -> bool:
    """A full-attention KV cache holding something (not a window, not a subclass)."""
    return type(cache) is KVCache and cache.keys is not None and cache.offset > 0


def _pad_left(x: mx.array, n: int) -> mx.array:
    if n == 0:
        return x
    b, h, _, d = x.shape
    return mx.concatenate([mx.zeros((b, h, n, d), dtype=x.dtype), x], axis=2)


class BatchQuantizedCache:
    """Rows of quantized KV caches: each of their parts (codes, scales, biases) in a
    `BatchTokenCache` of its own, so they pad, widen, lend and leave as plain rows do."""

    def __init__(self, template: QuantizedKVCache) -> None:
        self.bits, self.group_size = template.bits, template.group_size  # configured
        self.parts = tuple(BatchTokenCache(KVCache()) for _ in template.parts)
        self._group = template.group_size  # the size in use, once a row has joined

    @property
    def rows(self) -> int:
        return self.parts[0].rows

    @property
    def plain(self) -> bool:
        return True

    @property
    def offset(self) -> mx.array:
        return self.parts[0].offset

    @property
    def padding(self) -> list[int]:
        return self.parts[0].padding

    @property
    def state(self) -> list[mx.array]:
        return [a for p in self.parts for a in p.state]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def token_bytes(self) -> int:
        return sum(p.token_bytes() for p in self.parts)

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        return self.parts[0].make_mask(length, window)

    def update_quantized(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        """Quantize and append (B, H, L, D) keys/values, one row each; every column."""
        held = append(self.parts, keys, values, self.bits, self.group_size)
        self._group = held[0].group_size
        return held

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        qk, qv = self.update_quantized(keys, values)
        return qk.dequantize(keys.shape[-1]), qv.dequantize(values.shape[-1])

    def rewind(self, n: int) -> None:
        for part in self.parts:
            part.rewind(n)

    def _pair(self, k: Sequence[mx.array], v: Sequence[mx.array]) -> tuple[Quantized, Quantized]:
        bits, group = self.bits, self._group
        return Quantized(k[0], k[1], k[2], bits, group), Quantized(v[0], v[1], v[2], bits, group)

    def add(self, cache: QuantizedKVCache) -> None:
        """Join a row (`BatchTokenCache.add`: the first row's buffers are lent)."""
        for part, own in zip(self.parts, cache.parts, strict=True):
            part.add(own)
        if cache.offset:
            self._group = cache.held()[0].group_size  # type: ignore[index]

    def remove(self, rows: Sequence[int]) -> None:
        for part in self.parts:
            part.remove(rows)

    def view(self, i: int) -> tuple[Quantized, Quantized]:
        held = [p.view(i) for p in self.parts]
        return self._pair([h[0] for h in held], [h[1] for h in held])

    def row(self, i: int) -> QuantizedKVCache:
        parts = [p.row(i) for p in self.parts]
        assert all(isinstance(p, KVCache) for p in parts)
        return QuantizedKVCache.of(self.bits, self.group_size, parts)  # type: ignore[arg-type]


BatchCache: TypeAlias = (
    BatchTokenCache | BatchRecurrentCache | BatchQuantizedCache | RowTokenCache | BatchQuantizedRows
)
_TOKENS = (BatchTokenCache, BatchQuantizedCache, RowTokenCache, BatchQuantizedRows)


class BatchCaches:
    """One `BatchCache` per layer, and the rows (sequences) they hold, in order;
    `rows`: full-attention layers keep each row in buffers of its own (the module
    docstring)."""

    def __init__(self, template: Sequence[object], *, rows: bool = False) -> None:
        if not batchable(template):
            raise ValueError("these caches cannot be batched")
        self.layers: list[BatchCache] = [_batch_layer(c, rows) for c in template]

    @property
    def rows(self) -> int:
        return self.layers[0].rows if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def bytes_per_token(self) -> tuple[int, int]:
        """(bytes a row adds per token it holds, bytes a row holds whatever its length)."""
        per_token = fixed = 0
        for layer in self.layers:
            if isinstance(layer, _TOKENS):
                per_token += layer.token_bytes()
            elif layer.rows:
                fixed += layer.nbytes // layer.rows
        return per_token, fixed

    def padded_bytes_per_token(self) -> int:
        """The part of `bytes_per_token` in layers whose rows pad to the longest."""
        padded = (BatchTokenCache, BatchQuantizedCache)
        return sum(x.token_bytes() for x in self.layers if isinstance(x, padded))

    def add(self, caches: Sequence[object], *, copy: bool = False) -> None:
        """Join one sequence's caches (one per layer) as the last row; `copy`: rows in
        buffers of their own take copies, not the caches' buffers (someone else keeps
        those, and the rows are written in place)."""
        for layer, cache in zip(self.layers, caches, strict=True):
            if isinstance(layer, (RowTokenCache, BatchQuantizedRows)):
                layer.add(cache, copy=copy)  # type: ignore[arg-type]
            else:
                layer.add(cache)  # type: ignore[arg-type]
        mx.eval([a for layer in self.layers for a in layer.state])

    def remove(self, rows: Sequence[int]) -> None:
        for layer in self.layers:
            layer.remove(rows)

    def keep_steps(self) -> None:
        """Before a forward whose last tokens `rewind` may take back: recurrent layers
        keep their states after each of its positions (runtime/cache/batch_recurrent.py);
        token caches need nothing kept."""
        for layer in self.layers:
            if isinstance(layer, BatchRecurrentCache):
                layer.keep_steps()

    def rewind(self, n: int) -> None:
        """Every row forgets its last `n` tokens in every layer (recurrent layers: only
        within a forward that kept its steps, `keep_steps`; ValueError, and no layer
        changed, where one cannot)."""
        if not all(x.can_rewind(n) for x in self.layers if isinstance(x, BatchRecurrentCache)):
            raise ValueError(f"cannot rewind {n} tokens: no state was kept there")
        for layer in self.layers:
            layer.rewind(n)

    def row(self, i: int) -> list[RowCache]:
        """Row `i` as per-layer caches of its own, as it leaves (copies, or the buffers
        themselves when it is the only row: `remove` it next)."""
        return [layer.row(i) for layer in self.layers]

    def views(self, i: int) -> list[RowView] | None:
        """Row `i`'s keys and values in every layer, without a copy; None unless every
        layer is a full-attention token cache (all plain or all quantized)."""
        layers = self.layers
        plain = (BatchTokenCache, RowTokenCache)
        if all(isinstance(x, plain) and x.plain for x in layers):
            return [layer.view(i) for layer in layers]  # type: ignore[union-attr]
        if all(isinstance(x, (BatchQuantizedCache, BatchQuantizedRows)) for x in layers):
            return [layer.view(i) for layer in layers]  # type: ignore[union-attr]
        return None


def _batch_layer(cache: object, rows: bool) -> BatchCache:
    if isinstance(cache, RecurrentCache):
        return BatchRecurrentCache()
    if isinstance(cache, QuantizedKVCache):
        return BatchQuantizedRows(cache) if rows else BatchQuantizedCache(cache)
    if rows and type(cache) is KVCache:
        return RowTokenCache(step=cache.step)
    assert isinstance(cache, (KVCache, RotatingKVCache))
    return BatchTokenCache(cache)
