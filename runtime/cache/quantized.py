"""A key/value cache that holds keys and values quantized to 8 or 4 bits (`--kv-bits`).

Keys and values are stored as MLX's affine groups along head_dim (`mx.quantize`: uint32
words of codes, and one scale and one bias per `group_size` values in the model's
dtype), as llama.cpp's q8_0/q4_0 cache types and mlx-lm's QuantizedKVCache do. Each
token is quantized on its own when it is written, so a token's codes do not depend on
the chunk or the batch row it came in: a restore from the prefix trie or its disk tier
holds what computing it again holds, and greedy output with the prefix cache on equals
the output with it off (tests/runtime/batch/test_kv_bits.py). Attention reads the groups directly
(runtime/models/quantized_attention.py: the CPU kernel dequantizes a key block at a
time, Metal and CUDA run `mx.quantized_matmul`).

The three arrays (codes, scales, biases) live in three `KVCache`s, one each for the
keys' and the values' part: their growth in `step` columns, rewinding, buffer lending
and the batch's left-padded rows (runtime/cache/batch.py) work on any (B, H, T, X)
arrays, so this cache and its batched form are thin layers over them.

At 8 bits the keys are stored rotated by a Hadamard matrix (`rotate`; the queries meet
them rotated the same way, which leaves every score as it was): Qwen2's first layer has
key channels 15x the others (its key bias, turned by RoPE), and quantized as they are
they took every other channel's precision (perplexity +6%, below). Rotated, each channel
carries a share of them. At 4 bits the rotated keys lost more over a long context than
the plain ones, so they stay plain there, in groups of 32.

Bytes per token and KV head, head_dim 64, float32 scales (the CPU): 256 float32, 72 at
8 bits (groups of 64), 40 at 4 bits (groups of 32). Measured on Qwen2.5-Coder-0.5B
(Q4_K_M GGUF, float32 compute, CPU, 2 busy cores; bench/kv_bits.py): greedy agreement
with the float cache over 256 tokens of 4 prompts (tokens to the first divergence, and
positions holding the same token), perplexity over 3072 tokens of stdlib Python with how
often the most likely next token is the float cache's, decode tokens/s after a prompt
(the cache's MB at 8k). The noise floor is the float cache summed in another order
(greedy: every C kernel off; perplexity: MLX's attention in place of the kernel's).

    kv bits        first divergence    equal   perplexity        argmax   tok/s @512  @8k (MB)
    none           -                   100%    3.9244            100%     14.2        6.0 (201)
    noise floor    142, 53, 3, 17      27.4%   3.9244            100%     -           -
    8              142, 0, 3, 17       19.8%   3.9289 (+0.11%)   98.2%    13.8        9.8 (57)
    4              2, 2, 0, 0          1.3%    6.4584 (+65%)     72.1%    -           -
    8, keys plain  -                   -       4.1653 (+6.1%)    -        -           -
    4, rotated     1, 1, 1, 0          0.8%    18.911 (+380%)    -        -           -
    4, groups 64   -                   -       9.6931 (+147%)    -        -           -

(Decode speeds from a machine busy with other work; a second, busier run gave 4.5 tok/s
at 8k for the float cache, 5.1 for the 8-bit one.) So 8 bits change about one next-token
choice in 55 and perplexity by a tenth of a percent, and decode long contexts faster on
a CPU (the kernel reads a third of the bytes); 4 bits are lossy on this model. The default stays the float cache. A decode
step over the 8-bit cache through MLX's ops instead of the kernel: 12.8 tok/s at 512,
3.9 at 8k (runtime/models/quantized_attention.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from runtime.cache.kv import KVCache
from runtime.cache.mask import Mask
from runtime.cache.protocol import ArraySnapshot, Snapshot, close_all, copy_arrays

KV_BITS = (4, 8)
# values per scale and bias, by bits (32 where a head_dim is not a multiple of it): 4-bit
# codes need the finer groups (perplexity in the module docstring)
GROUP_SIZES = {8: 64, 4: 32}
# whether keys are stored rotated (`rotate`), by bits: at 8 bits it takes the loss from
# +6% perplexity to +0.1% where a few huge key channels (RoPE'd key biases, Qwen2's
# first layer) took every other channel's precision; at 4 bits the rotated keys lost
# more over a long context than the plain ones (the module docstring's table)
ROTATED_KEYS = {8: True, 4: False}
PAD = 32  # MLX's smallest group: a head_dim that is not a multiple is padded with zeros


def padded_dim(dim: int) -> int:
    """The width a head_dim of `dim` is quantized at: a multiple of 32. The padding
    changes no score (the queries are padded with zeros too) and is cut from the output."""
    return -(-dim // PAD) * PAD


def group_size_for(width: int, group_size: int) -> int:
    """The group size a (padded) head_dim of `width` is quantized in: `group_size`
    where it divides it, else 32."""
    return group_size if width % group_size == 0 else PAD


def rotate(x: mx.array) -> mx.array:
    """`x` (..., width) times the normalized Hadamard matrix of its width (block-diagonal,
    in blocks of the largest power of two dividing it, where it is not one): orthogonal
    and its own inverse, so scores q.k are those of the rotated q and k, and each of a
    key's rotated channels carries a share of its outliers. `mx.hadamard_transform`,
    in float32: each vector on its own, so the same bits whatever the batch or chunk."""
    width = int(x.shape[-1])
    block = width & -width
    y = x.astype(mx.float32)
    if block != width:
        y = y.reshape(*x.shape[:-1], width // block, block)
    y = mx.hadamard_transform(y, scale=block**-0.5)
    return y.reshape(x.shape).astype(x.dtype)


@dataclass(frozen=True)
class Quantized:
    """Keys or values of some tokens as affine groups: `data` (B, H, T, D * bits / 32)
    uint32 codes, `scales` and `biases` (B, H, T, D / group_size); `rotated`: of the
    vectors times `rotate`'s matrix (a cache's keys)."""

    data: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    rotated: bool = False

    @property
    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.data, self.scales, self.biases

    @property
    def tokens(self) -> int:
        return int(self.data.shape[2])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def span(self, start: int, end: int) -> Quantized:
        """Tokens [start, end) (views)."""
        data, scales, biases = (a[..., start:end, :] for a in self.arrays)
        return Quantized(data, scales, biases, self.bits, self.group_size, self.rotated)

    @property
    def width(self) -> int:
        """The head_dim it was quantized at (`padded_dim` of the model's)."""
        return int(self.data.shape[-1]) * 32 // self.bits

    def dequantize(self, dim: int | None = None) -> mx.array:
        """The vectors, as floats of the scales' dtype (rotated back); `dim`: the
        model's head_dim (the padding `quantize` added cut off)."""
        out = mx.dequantize(
            self.data, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        )
        if self.rotated:
            out = rotate(out)
        return out if dim is None or dim == self.width else out[..., :dim]


def quantize(x: mx.array, bits: int, group_size: int, *, rotated: bool = False) -> Quantized:
    """(B, H, T, D) keys or values as groups along D (padded to `padded_dim`, in groups
    of `group_size_for` it); `rotated`: of `rotate(x)`."""
    dim = int(x.shape[-1])
    width = padded_dim(dim)
    if width != dim:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - dim)])
    if rotated:
        x = rotate(x)
    size = group_size_for(width, group_size)
    data, scales, biases = mx.quantize(x, group_size=size, bits=bits)
    return Quantized(data, scales, biases, bits, size, rotated)


def _parts(arrays: Sequence[mx.array], bits: int, group: int) -> tuple[Quantized, Quantized]:
    """Six arrays, keys' codes/scales/biases then values', as (keys, values): a cache's
    keys rotated as `ROTATED_KEYS` says, its values never (`append`)."""
    kd, ks, kb, vd, vs, vb = arrays
    keys = Quantized(kd, ks, kb, bits, group, ROTATED_KEYS[bits])
    return keys, Quantized(vd, vs, vb, bits, group)


class TokenBuffers(Protocol):
    """One part's keys and values, growing by tokens (a `KVCache`, or a batch's)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...


def append(
    parts: Sequence[TokenBuffers], keys: mx.array, values: mx.array, bits: int, group_size: int
) -> tuple[Quantized, Quantized]:
    """Quantize (B, H, L, D) keys (rotated where `ROTATED_KEYS` says) and values,
    append their codes, scales and biases to the three `parts`; return everything the
    parts hold."""
    qk = quantize(keys, bits, group_size, rotated=ROTATED_KEYS[bits])
    qv = quantize(values, bits, group_size)
    held = [
        part.update_and_fetch(k, v) for part, k, v in zip(parts, qk.arrays, qv.arrays, strict=True)
    ]
    return _parts([h[0] for h in held] + [h[1] for h in held], bits, qk.group_size)


class QuantizedSnapshot(ArraySnapshot):
    """Quantized keys and values of positions [base, end), a delta on top of [0, base);
    the arrays are the keys' codes, scales, biases, then the values'."""

    def __init__(
        self,
        arrays: Sequence[mx.array],
        base: int,
        end: int,
        bits: int,
        group_size: int,
        configured: int,
    ) -> None:
        if len(arrays) != 6:
            raise ValueError(f"a quantized KV snapshot has 6 arrays, got {len(arrays)}")
        super().__init__(arrays, base=base, end=end, floor=base)
        self.bits = bits
        self.group_size = group_size  # the size the arrays are in (`group_size_for`)
        self.configured = configured  # the cache's configured size (its disk layout)

    @classmethod
    def of(
        cls, keys: Quantized, values: Quantized, base: int, end: int, configured: int
    ) -> QuantizedSnapshot:
        arrays = (*keys.arrays, *values.arrays)
        return cls(arrays, base, end, keys.bits, keys.group_size, configured)

    @property
    def keys(self) -> Quantized:
        return _parts(self.arrays, self.bits, self.group_size)[0]

    @property
    def values(self) -> Quantized:
        return _parts(self.arrays, self.bits, self.group_size)[1]


class QuantizedKVCache:
    """Keys and values of every token seen, quantized (see the module docstring); it can
    rewind to any offset, as `KVCache` does."""

    def __init__(self, bits: int = 8, group_size: int | None = None, step: int = 256) -> None:
        if bits not in KV_BITS:
            raise ValueError(f"kv bits must be one of {KV_BITS}, got {bits}")
        group_size = group_size or GROUP_SIZES[bits]
        self.bits = bits
        self.group_size = group_size  # as configured; a head_dim may need 32
        self.step = step
        # codes, scales, biases: each a KVCache holding the keys' and the values' part
        self.parts = (KVCache(step), KVCache(step), KVCache(step))
        self._group = group_size  # the size in use, once keys have been seen

    @classmethod
    def of(cls, bits: int, group_size: int, parts: Sequence[KVCache]) -> QuantizedKVCache:
        """A cache over these parts (codes, scales, biases; the batch's rows leaving)."""
        cache = cls(bits, group_size)
        cache.parts = (parts[0], parts[1], parts[2])
        keys = parts[0].keys
        if keys is not None:
            cache._group = group_size_for(keys.shape[-1] * 32 // bits, group_size)
        return cache

    @property
    def offset(self) -> int:
        return self.parts[0].offset

    def reserve(self, tokens: int) -> None:
        """Make room for a prompt of `tokens` tokens in all (`KVCache.reserve`)."""
        for part in self.parts:
            part.reserve(tokens)

    def update_quantized(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        """Quantize and append (B, n_kv_heads, L, head_dim) keys/values; return all held."""
        held = append(self.parts, keys, values, self.bits, self.group_size)
        self._group = held[0].group_size
        return held

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """As `update_quantized`, dequantized: what a layer that does not read the groups
        itself attends to (the same values the quantized attention sees)."""
        qk, qv = self.update_quantized(keys, values)
        return qk.dequantize(keys.shape[-1]), qv.dequantize(values.shape[-1])

    def make_mask(self, length: int, window: int | None = None) -> Mask:
        return self.parts[0].make_mask(length, window)

    def held(self) -> tuple[Quantized, Quantized] | None:
        """The tokens held, as views; None when empty."""
        if self.parts[0].keys is None:
            return None
        n = self.offset
        arrays = [a[..., :n, :] for a in self._buffers()]
        return _parts(arrays, self.bits, self._group)

    @property
    def keys(self) -> Quantized | None:
        """The keys' whole buffers (capacity, not just the tokens held)."""
        if self.parts[0].keys is None:
            return None
        return _parts(self._buffers(), self.bits, self._group)[0]

    @property
    def values(self) -> Quantized | None:
        if self.parts[0].keys is None:
            return None
        return _parts(self._buffers(), self.bits, self._group)[1]

    def _buffers(self) -> list[mx.array]:
        """The six buffers: keys' codes, scales, biases, then the values'."""
        out: list[mx.array] = []
        for which in ("keys", "values"):
            for part in self.parts:
                a = getattr(part, which)
                assert a is not None
                out.append(a)
        return out

    @property
    def state(self) -> list[mx.array]:
        return [a for p in self.parts for a in p.state]

    def trim(self, n: int) -> int:
        dropped = 0
        for part in self.parts:
            dropped = part.trim(n)
        return dropped

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers (capacity): what the codes and groups take."""
        return sum(p.nbytes for p in self.parts)

    # -- paging (runtime/cache/protocol.py) --

    @property
    def rewindable(self) -> bool:
        return True

    @property
    def rewind_floor(self) -> int:
        return 0

    def snapshot(self, from_offset: int) -> QuantizedSnapshot | None:
        start, end = max(0, from_offset), self.offset
        if self.parts[0].keys is None or start >= end:
            return None
        arrays = copy_arrays(*(a[..., start:end, :] for a in self._buffers()))
        return QuantizedSnapshot(arrays, start, end, self.bits, self._group, self.group_size)

    def _usable(self, snap: Snapshot | None) -> QuantizedSnapshot | None:
        if not isinstance(snap, QuantizedSnapshot) or snap.closed:
            return None
        return snap if (snap.bits, snap.configured) == (self.bits, self.group_size) else None

    def restore(self, snapshot: Snapshot | None, target: int) -> bool:
        if snapshot is None or target == 0:
            if not 0 <= target <= self.offset:
                return False
            for part in self.parts:
                part.restore(None, target)
            return True
        snap = self._usable(snapshot)
        if snap is None or not snap.base <= target <= snap.end or snap.base > self.offset:
            return False
        count = target - snap.base
        arrays = snap.arrays
        for i, part in enumerate(self.parts):
            part.restore(None, snap.base)
            if count > 0:
                part.update_and_fetch(arrays[i][..., :count, :], arrays[i + 3][..., :count, :])
        if count > 0:
            self._group = snap.group_size
        return True

    def merge(self, parent: Snapshot | None, child: Snapshot | None) -> Snapshot | None:
        first, second = self._usable(parent), self._usable(child)
        merged = None
        if (
            first is not None
            and second is not None
            and first.end == second.base
            and first.group_size == second.group_size
        ):
            arrays = [
                mx.concatenate([a, b], axis=2)
                for a, b in zip(first.arrays, second.arrays, strict=True)
            ]
            mx.async_eval(*arrays)
            merged = QuantizedSnapshot(
                arrays, first.base, second.end, self.bits, first.group_size, self.group_size
            )
        close_all(parent, child)
        return merged

    def split(self, snapshot: Snapshot, at: int) -> tuple[Snapshot | None, Snapshot | None]:
        snap = self._usable(snapshot)
        if snap is None or at <= snap.base:
            return None, snapshot
        if at >= snap.end:
            return snapshot, None
        n = at - snap.base
        head = copy_arrays(*(a[..., :n, :] for a in snap.arrays))
        tail = copy_arrays(*(a[..., n:, :] for a in snap.arrays))
        snapshot.close()
        bits, group, configured = snap.bits, snap.group_size, self.group_size
        return (
            QuantizedSnapshot(head, snap.base, at, bits, group, configured),
            QuantizedSnapshot(tail, at, snap.end, bits, group, configured),
        )

    def free(self) -> None:
        for part in self.parts:
            part.free()

    def hold(self, keys: Quantized, values: Quantized, offset: int) -> None:
        """Take these buffers as its own, without a copy (`KVCache.hold`)."""
        if keys.bits != self.bits:
            raise ValueError(f"{keys.bits}-bit buffers held by a {self.bits}-bit cache")
        for part, k, v in zip(self.parts, keys.arrays, values.arrays, strict=True):
            part.hold(k, v, offset)
        self._group = keys.group_size


def quantizing(
    make_caches: Callable[[], Sequence[Any]], bits: int | None, group_size: int | None = None
) -> Callable[[], list[Any]]:
    """`make_caches` with every plain `KVCache` (a full-attention layer's) made a
    `QuantizedKVCache` of `bits` bits; `bits` None: `make_caches` as it is. Sliding
    windows, latent (MLA) and recurrent layers keep their own caches."""
    if bits is None:
        return lambda: list(make_caches())
    if bits not in KV_BITS:
        raise ValueError(f"kv bits must be one of {KV_BITS}, got {bits}")

    def make() -> list[Any]:
        return [
            QuantizedKVCache(bits, group_size) if type(c) is KVCache else c for c in make_caches()
        ]

    return make
