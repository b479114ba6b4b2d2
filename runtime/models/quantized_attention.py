"""Attention over a quantized KV cache (`--kv-bits`, runtime/cache/quantized.py), reading
its groups where they are.

- CPU: the C kernel (`cpu_kernels.quantized_attention`) dequantizes a block of keys and
  values at a time inside its blocked online softmax, so the cache is read at its own
  size and never written out in float. It takes a batch's left padding as each row's
  first key. Decode steps come here too (`DECODE_KERNEL`): MLX has no fast path for
  them on the CPU (its quantized matmul is a scalar loop on one thread, and
  dequantizing the whole cache for its attention writes the float cache out every
  step), so the kernel's evaluation per layer is the cheaper price.
- A running batch whose rows keep buffers of their own (runtime/cache/rows.py): the same
  kernel a row at a time, as an MLX primitive (`rows_attention`): no evaluation per layer.
- Keys stored rotated (8 bits, runtime/cache/quantized.py `rotate`) meet queries rotated
  the same way, which leaves every score as it was.
- Metal and CUDA (and a CPU without the kernels): scores = q @ dequant(K).T with
  `mx.quantized_matmul` on the codes, the softmax in float32, then @ dequant(V) the same
  way; long prompts in query blocks, each seeing only the keys up to its end.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from runtime import kernels as cpu_kernels
from runtime.cache import BatchQuantizedRows, Mask, Quantized, rotate, window_mask

# Decode steps (fewer query rows than the kernels' MIN_ROWS) on the CPU take the kernel:
# measured in the module docstring of runtime/cache/quantized.py
DECODE_KERNEL = True
QUERY_BLOCK = 256


def quantized_attention(
    q: mx.array,
    keys: Quantized,
    values: Quantized,
    *,
    scale: float,
    mask: Mask,
    padding: Sequence[int] | None = None,
    block: int = QUERY_BLOCK,
) -> mx.array:
    """(B, Hq, L, D) queries over (B, Hkv, K, ...) quantized keys/values; Hq a multiple
    of Hkv; the queries are the last L of the K positions.

    `padding`: each batch row's padding columns, when `mask` is exactly "those hidden,
    causal" (a batch's decode step, runtime/cache/batch.py): the CPU kernel then skips
    them instead of reading a mask.
    """
    out = _attention(_queries(q, keys), keys, values, scale, mask, padding, block)
    return _outputs(out, values, q.shape[-1])


def rows_attention(
    q: mx.array, k: mx.array, v: mx.array, cache: BatchQuantizedRows, *, scale: float
) -> mx.array:
    """A batch's (B, Hq, L, D) queries, after their (B, Hkv, L, D) keys and values are
    appended to rows in buffers of their own (runtime/cache/rows.py: in place, one node
    where the CPU primitive runs): the CPU kernel a row at a time, as a primitive in the
    step's graph (the same bits as over the rows left-padded), else `quantized_attention`
    over a left-padded copy."""
    length = q.shape[2]
    cache.extend(k, v, cpu_kernels.append_rows)
    rows = cache.buffers()
    keys, values = rows[0]
    out = cpu_kernels.quantized_attention_rows(
        _queries(q, keys), [(ks.arrays, vs.arrays) for ks, vs in rows], cache.tokens.lengths,
        bits=keys.bits, group_size=keys.group_size, scale=scale,
    )  # fmt: skip
    if out is not None:
        return _outputs(out, values, q.shape[-1])
    padded_k, padded_v = cache.padded()
    mask = cache.tokens.written_mask(length)
    return quantized_attention(q, padded_k, padded_v, scale=scale, mask=mask, padding=cache.padding)


def _queries(q: mx.array, keys: Quantized) -> mx.array:
    """Queries in the keys' width and basis."""
    dim, width = q.shape[-1], keys.width
    if width != dim:  # a head_dim padded to quantize it: zeros add nothing to the scores
        q = mx.pad(q, [(0, 0), (0, 0), (0, 0), (0, width - dim)])
    if keys.rotated:  # the keys' basis: rotating both leaves every score as it was
        q = rotate(q)
    return q


def _outputs(out: mx.array, values: Quantized, dim: int) -> mx.array:
    """Outputs back in the model's basis and head_dim."""
    if values.rotated:
        out = rotate(out)
    return out if values.width == dim else out[..., :dim]


def _attention(
    q: mx.array,
    keys: Quantized,
    values: Quantized,
    scale: float,
    mask: Mask,
    padding: Sequence[int] | None,
    block: int,
) -> mx.array:
    length, count = q.shape[2], keys.tokens
    simple = mask is None or isinstance(mask, str) or padding is not None
    if simple and (DECODE_KERNEL or length >= cpu_kernels.MIN_ROWS):
        out = cpu_kernels.quantized_attention(
            q, keys.arrays, values.arrays, bits=keys.bits, group_size=keys.group_size,
            scale=scale, causal=mask is not None, starts=padding,
        )  # fmt: skip
        if out is not None:
            return out
    if length > block and (mask == "causal" or _query_key_mask(mask, length, count)):
        outs = []
        for start in range(0, length, block):
            end = min(start + block, length)
            seen = count - length + end  # keys before this block's last query, inclusive
            sub = mask if isinstance(mask, str) else mask[..., start:end, :seen]  # type: ignore[index]
            k, v = keys.span(0, seen), values.span(0, seen)
            outs.append(_attend(q[:, :, start:end], k, v, scale, sub))
        return mx.concatenate(outs, axis=2)
    return _attend(q, keys, values, scale, mask)


def _query_key_mask(mask: Mask, length: int, keys: int) -> bool:
    return isinstance(mask, mx.array) and mask.shape[-2:] == (length, keys)


def _attend(q: mx.array, keys: Quantized, values: Quantized, scale: float, mask: Mask) -> mx.array:
    """MLX ops: the query heads sharing a KV head grouped, so K and V are not repeated."""
    batch, q_heads, length, dim = q.shape
    kv_heads, count = keys.data.shape[1], keys.tokens
    q = (q * scale).reshape(batch, kv_heads, q_heads // kv_heads, length, dim)
    bits, group = keys.bits, keys.group_size
    kd, ks, kb = (mx.expand_dims(a, 2) for a in keys.arrays)
    scores = mx.quantized_matmul(q, kd, ks, kb, transpose=True, group_size=group, bits=bits)
    if isinstance(mask, str):
        mask = window_mask(length, count, None)
    if mask is not None:
        if mask.ndim == 4:  # (B, 1, L, K): one mask for all the heads of a row
            mask = mx.expand_dims(mask, 2)
        scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=scores.dtype))
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
    vd, vs, vb = (mx.expand_dims(a, 2) for a in values.arrays)
    out = mx.quantized_matmul(probs, vd, vs, vb, transpose=False, group_size=group, bits=bits)
    return out.reshape(batch, q_heads, length, values.width)
