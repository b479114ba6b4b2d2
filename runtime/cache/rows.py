"""A running batch's full-attention caches with each row in buffers of its own.

The left-padded layout (runtime/cache/batch.py `BatchTokenCache`) gives every row the
longest row's columns: a 32k prompt joining three short rows made each hold 32k columns
of keys and values (4 x 32k x 112 KB on a 7B shape: 15 GB). Here a row keeps the buffers
it came with, growing `step` columns at a time as a `KVCache` does, so the batch holds
the sum of its rows' lengths plus fewer than `step` spare columns a row, and joining
and leaving copy nothing: a joining row's buffers are its cache's, and a leaving row's
buffers become its cache's again. The exception: a row joining from caches that stay
in use (the trie keeps a window or recurrent model's live caches, and the next request
on the same path joins from the same buffers) takes copies, so that no two rows write
the same memory.

A step appends to every row and reads every row in two graph nodes a layer: the CPU
kernels' `append_rows` (in place; the models layer hands it in as `Writer`) and their
attention over a list of rows (runtime/models/base.py), which plans its work as over
the left-padded rows, so every row's output has the same bits. Written in place, a
buffer's columns from its row's length on change under whoever else holds it (the
trie's live cache it came from): they hold only the columns before it. Without the
kernels (`Writer` None, or another attention) every row takes MLX slice updates and the
step reads a left-padded copy of the rows, with the padded layout's mask: correct, and
slower than the padded layout, which Metal, CUDA and a CPU without the kernels keep
(runtime/batch/running.py chooses).

Measured on Qwen2.5-Coder-0.5B (Q4_K_M GGUF, float32 KV, CPU, 2 busy cores; decode
steps of the real model, the two layouts alternating, best of 10): a 3000-token row among
three of 30 holds 94 MB where the padded batch held 320 (8 bits: 27 and 90), and one
among seven 120 MB against 640; a step takes 0.97-1.01x the padded step's time (8 bits:
0.91x, the quantized kernel now in the step's graph instead of one evaluation a layer).

Rows are held part-major: `parts[p][b]` is row b's p-th buffer, (1, H, capacity, X): keys
and values, or a quantized cache's codes, scales and biases of each (`BatchQuantizedRows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import mlx.core as mx

from runtime.cache.kv import KVCache
from runtime.cache.mask import Mask
from runtime.cache.quantized import ROTATED_KEYS, Quantized, QuantizedKVCache, quantize

# (new arrays per part, part-major rows, each row's length after) -> the rows written, or
# None where it does not run (the CPU kernels' `append_rows`)
Writer: TypeAlias = Callable[
    [Sequence[mx.array], Sequence[Sequence[mx.array]], Sequence[int]], list[list[mx.array]] | None
]


class RowTokenCache:
    """Rows of full-attention caches, each in buffers of its own (the module docstring);
    `width` buffers a row."""

    def __init__(self, width: int = 2, step: int = 256) -> None:
        self.width = width
        self.step = step
        self.parts: list[list[mx.array]] = [[] for _ in range(width)]
        self.lengths: list[int] = []  # each row's tokens

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def plain(self) -> bool:
        return True

    @property
    def offset(self) -> mx.array:
        """Each row's position, (B,)."""
        return mx.array(self.lengths, dtype=mx.int32)

    @property
    def padding(self) -> list[int]:
        """Each row's padding in the left-padded copy (`padded`): the columns before its
        first token."""
        longest = max(self.lengths, default=0)
        return [longest - n for n in self.lengths]

    @property
    def state(self) -> list[mx.array]:
        return [a for part in self.parts for a in part]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state)

    def token_bytes(self) -> int:
        """Bytes a row's token takes in the buffers."""
        if not self.lengths:
            return 0
        return sum(int(part[0].nbytes) // max(1, part[0].shape[2]) for part in self.parts)

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        """The left-padded copy's mask for the next `length` tokens (a step that does not
        read the rows where they are): each row sees its own tokens, causally."""
        return _padded_mask(self.lengths, length, window)

    def written_mask(self, length: int) -> Mask:
        """`make_mask` as it was before the last `length` tokens were written."""
        return _padded_mask([n - length for n in self.lengths], length, None)

    # -- writing --

    def extend(self, news: Sequence[mx.array], write: Writer | None = None) -> None:
        """Append (B, H, L, X) arrays, one per buffer of a row, to every row: through
        `write` (in place, one node) where it runs, else MLX slice updates."""
        length = int(news[0].shape[2])
        self._make_room(length)
        ends = [n + length for n in self.lengths]
        written = None if write is None else write(news, self.parts, ends)
        if written is not None:
            self.parts = [list(part) for part in written]
        else:  # functional updates: a buffer another cache shares is copied, not written
            for part, new in zip(self.parts, news, strict=True):
                for b, n in enumerate(self.lengths):
                    at = mx.array([n], dtype=mx.int32)
                    part[b] = mx.slice_update(part[b], new[b : b + 1], at, axes=(2,))
        self.lengths = ends

    def write_with(
        self, length: int, write: Callable[[list[list[mx.array]], list[int]], list[list[mx.array]]]
    ) -> None:
        """Append `length` tokens to every row through `write(buffers, ends)`, a primitive
        that computes them and writes them in place (runtime/models/fused_layer.py): the
        buffers it returns are the rows'."""
        self._make_room(length)
        ends = [n + length for n in self.lengths]
        self.parts = [list(part) for part in write(self.parts, ends)]
        self.lengths = ends

    def _make_room(self, length: int) -> None:
        """Grow the rows that lack room for `length` more tokens (`step` columns at a
        time, copying the row's tokens once, as `KVCache` grows)."""
        for b, n in enumerate(self.lengths):
            if n + length <= self.parts[0][b].shape[2]:
                continue
            capacity = -(-(n + length) // self.step) * self.step
            for part in self.parts:
                old = part[b]
                _, heads, _, width = old.shape
                spare = mx.zeros((1, heads, capacity - n, width), dtype=old.dtype)
                part[b] = mx.concatenate([old[..., :n, :], spare], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (B, H, L, D) keys/values; return the rows left-padded (`padded`)."""
        self.extend([keys, values])
        return self.padded(0), self.padded(1)

    def padded(self, p: int) -> mx.array:
        """Part `p` of every row as one left-padded (B, H, longest, X) copy."""
        longest = max(self.lengths)
        rows = []
        for buffer, n in zip(self.parts[p], self.lengths, strict=True):
            row = buffer[..., :n, :]
            if n < longest:
                _, heads, _, width = buffer.shape
                pad = mx.zeros((1, heads, longest - n, width), dtype=buffer.dtype)
                row = mx.concatenate([pad, row], axis=2)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def rewind(self, n: int) -> None:
        """Every row forgets its last `n` tokens (a speculative step's rejected ones)."""
        if not 0 <= n <= min(self.lengths, default=0):
            raise ValueError(f"cannot rewind {n} tokens of rows of {self.lengths}")
        self.lengths = [m - n for m in self.lengths]

    # -- rows joining and leaving --

    def add_buffers(self, buffers: Sequence[mx.array], length: int, *, copy: bool = False) -> None:
        """Join a row holding `length` tokens in these buffers: new array objects on the
        same memory (no copy; `mx.array(x)` would copy), so that the caller's own slice
        updates never rebind what the row holds. The caller's first `length` columns
        keep what they hold: this batch writes only after them, so the buffers must be
        no other row's. `copy`: copies instead (the caller hands the same buffers on)."""
        if len(buffers) != self.width or length < 1:
            raise ValueError("a row joins with a buffer per part, after its prompt has run")
        for part, buffer in zip(self.parts, buffers, strict=True):
            part.append(mx.array(buffer) if copy else mx.view(buffer, buffer.dtype))
        self.lengths.append(length)

    def add(self, cache: KVCache, *, copy: bool = False) -> None:
        if cache.keys is None or cache.values is None:
            raise ValueError("a row joins only after its prompt has run")
        self.add_buffers([cache.keys, cache.values], cache.offset, copy=copy)

    def remove(self, rows: Sequence[int]) -> None:
        """Drop rows (nothing is copied)."""
        gone = set(rows)
        keep = [i for i in range(self.rows) if i not in gone]
        self.parts = [[part[i] for i in keep] for part in self.parts]
        self.lengths = [self.lengths[i] for i in keep]

    def buffers(self, i: int) -> list[mx.array]:
        """Row `i`'s buffers (capacity, not just its tokens)."""
        return [part[i] for part in self.parts]

    def view(self, i: int) -> tuple[mx.array, mx.array]:
        """Row `i`'s keys and values, oldest first, without a copy."""
        n = self.lengths[i]
        return self.parts[0][i][..., :n, :], self.parts[1][i][..., :n, :]

    def row(self, i: int) -> KVCache:
        """Row `i` as a cache of its own, holding its buffers (no copy: `remove` it)."""
        own = KVCache(self.step)
        keys, values = self.buffers(i)
        own.hold(keys, values, self.lengths[i])
        return own


class BatchQuantizedRows:
    """Rows of quantized KV caches (runtime/cache/quantized.py), each in buffers of its
    own: a `RowTokenCache` of six buffers a row, the keys' codes, scales and biases, then
    the values'."""

    def __init__(self, template: QuantizedKVCache) -> None:
        self.bits, self.group_size = template.bits, template.group_size  # configured
        self.tokens = RowTokenCache(width=6, step=template.step)
        self._group = template.group_size  # the size in use, once a row has joined

    @property
    def rows(self) -> int:
        return self.tokens.rows

    @property
    def plain(self) -> bool:
        return True

    @property
    def offset(self) -> mx.array:
        return self.tokens.offset

    @property
    def padding(self) -> list[int]:
        return self.tokens.padding

    @property
    def state(self) -> list[mx.array]:
        return self.tokens.state

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes

    def token_bytes(self) -> int:
        return self.tokens.token_bytes()

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        return self.tokens.make_mask(length, window)

    def extend(self, keys: mx.array, values: mx.array, write: Writer | None = None) -> None:
        """Quantize (B, H, L, D) keys/values (each token on its own, as
        `QuantizedKVCache` does) and append them to every row."""
        qk = quantize(keys, self.bits, self.group_size, rotated=ROTATED_KEYS[self.bits])
        qv = quantize(values, self.bits, self.group_size)
        self._group = qk.group_size
        self.tokens.extend([*qk.arrays, *qv.arrays], write)

    def buffers(self) -> list[tuple[Quantized, Quantized]]:
        """Every row's keys and values over its whole buffers (`tokens.lengths` held)."""
        out = []
        for i in range(self.rows):
            held = self.tokens.buffers(i)
            out.append(self._pair(held[:3], held[3:]))
        return out

    def padded(self) -> tuple[Quantized, Quantized]:
        """Every row left-padded in one copy (`padding` says where each starts)."""
        arrays = [self.tokens.padded(p) for p in range(6)]
        return self._pair(arrays[:3], arrays[3:])

    def update_quantized(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        """Append; every row left-padded in one copy (a step not reading the rows where
        they are: `padding` says where each starts)."""
        self.extend(keys, values)
        return self.padded()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        qk, qv = self.update_quantized(keys, values)
        return qk.dequantize(keys.shape[-1]), qv.dequantize(values.shape[-1])

    def rewind(self, n: int) -> None:
        self.tokens.rewind(n)

    def _pair(self, k: Sequence[mx.array], v: Sequence[mx.array]) -> tuple[Quantized, Quantized]:
        bits, group = self.bits, self._group
        return (
            Quantized(k[0], k[1], k[2], bits, group, ROTATED_KEYS[bits]),
            Quantized(v[0], v[1], v[2], bits, group),
        )

    def add(self, cache: QuantizedKVCache, *, copy: bool = False) -> None:
        keys, values = cache.keys, cache.values
        if keys is None or values is None:
            raise ValueError("a row joins only after its prompt has run")
        self.tokens.add_buffers([*keys.arrays, *values.arrays], cache.offset, copy=copy)
        self._group = keys.group_size

    def remove(self, rows: Sequence[int]) -> None:
        self.tokens.remove(rows)

    def view(self, i: int) -> tuple[Quantized, Quantized]:
        n = self.tokens.lengths[i]
        held = [b[..., :n, :] for b in self.tokens.buffers(i)]
        return self._pair(held[:3], held[3:])

    def row(self, i: int) -> QuantizedKVCache:
        """Row `i` as a cache of its own, holding its buffers (no copy: `remove` it)."""
        own = QuantizedKVCache(self.bits, self.group_size, self.tokens.step)
        buffers = self.tokens.buffers(i)
        k, v = self._pair(buffers[:3], buffers[3:])
        own.hold(k, v, self.tokens.lengths[i])
        return own


def _padded_mask(lengths: Sequence[int], length: int, window: int | None) -> Mask:
    """(B, 1, L, K): rows of these lengths left-padded to the longest, then `length` new
    tokens each; a row's queries see its own tokens, causally, within `window`."""
    longest = max(lengths, default=0)
    total = longest + length
    if length == 1 and len(set(lengths)) <= 1 and (window is None or total <= window):
        return None
    k_col = mx.arange(total)[None, None, None, :]
    q_col = mx.arange(longest, total)[None, None, :, None]
    left = mx.array([longest - n for n in lengths], dtype=mx.int32)[:, None, None, None]
    allowed = (k_col >= left) & (k_col <= q_col)
    if window is not None:
        allowed = allowed & (q_col - k_col < window)
    return allowed
