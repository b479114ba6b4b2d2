"""Shared model pieces: norms, MLP, attention (GQA, masks, optional soft-capping), protocols."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx.nn.layers.activations import gelu, silu
from mlx.nn.layers.base import Module

from runtime import kernels as cpu_kernels
from runtime.cache import (
    BatchQuantizedCache,
    BatchQuantizedRows,
    BatchTokenCache,
    Cache,
    KVCache,
    Mask,
    QuantizedKVCache,
    RaggedCache,
    RotatingKVCache,
    RowTokenCache,
    window_mask,
)
from runtime.models.linear import Embedding, Linear, fused_products
from runtime.models.quantized_attention import quantized_attention, rows_attention
from runtime.models.rope import RoPE

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class ArgsLike(Protocol):
    """The fields every architecture's ModelArgs carries."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...


class LanguageModel(Protocol):
    """A causal language model over per-layer caches (what `build_model` returns)."""

    @property
    def args(self) -> ArgsLike: ...

    def forward(self, tokens: mx.array, caches: Sequence[Cache] | None = None) -> mx.array:
        """(B, L) int32 tokens -> (B, L, hidden) states after the final norm."""
        ...

    def logits(self, hidden: mx.array) -> mx.array: ...

    def __call__(self, tokens: mx.array, caches: Sequence[Cache] | None = None) -> mx.array: ...

    def make_caches(self) -> list[Cache]: ...

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]: ...

    def parameters(self) -> Any: ...

    def load_weights(
        self, file_or_weights: str | list[tuple[str, mx.array]], strict: bool = True
    ) -> Module: ...


class RMSNorm(Module):
    """RMSNorm; `unit_offset` gives gemma's variant, which scales by (1 + weight)."""

    def __init__(self, dims: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        # gemma stores weights centred on 0, llama on 1
        self.weight = mx.zeros((dims,)) if unit_offset else mx.ones((dims,))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: mx.array) -> mx.array:
        out = cpu_kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
        if out is not None:
            return out
        weight = 1.0 + self.weight if self.unit_offset else self.weight
        return mx.fast.rms_norm(x, weight, self.eps)


def _gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


_ACTIVATIONS: Mapping[str, Callable[[mx.array], mx.array]] = {
    "silu": silu,
    "swish": silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu": gelu,
}


# activation name -> the CPU kernels' name for the same function (cpu_kernels.gated_mul)
_KERNEL_ACTIVATIONS: Mapping[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}


def activation(name: str) -> Callable[[mx.array], mx.array]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}") from None


class MLP(Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, dims: int, hidden: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(dims, hidden, bias=bias)
        self.up_proj = Linear(dims, hidden, bias=bias)
        self.down_proj = Linear(hidden, dims, bias=bias)
        self._act = activation(act)
        self._kernel_act = _KERNEL_ACTIVATIONS.get(act)

    @property
    def kernel_activation(self) -> str | None:
        """The CPU kernels' name of the gated activation ("silu", "gelu_tanh"), or None
        where they have none."""
        return self._kernel_act

    def __call__(self, x: mx.array) -> mx.array:
        if self._kernel_act is not None:
            # quantized on the CPU: gate, up and the activation in one primitive
            fused = fused_products(x, (self.gate_proj, self.up_proj), self._kernel_act)
            if fused is not None:
                return self.down_proj(fused[0])
        gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = None
        if self._kernel_act is not None:
            # on the CPU, MLX's scalar exp makes the activation cost half a matmul
            hidden = cpu_kernels.gated_mul(gate, up, self._kernel_act)
        if hidden is None:
            hidden = self._act(gate) * up
        return self.down_proj(hidden)


def _softcapped_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask, softcap: float
) -> mx.array:
    """Attention with tanh soft-capped scores, which the fused kernel cannot do."""
    batch, q_heads, length, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    # Group query heads by the key head they share instead of repeating k and v.
    q = q.reshape(batch, kv_heads, q_heads // kv_heads, length, q.shape[-1])
    scores = (q * scale) @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):
        mask = window_mask(length, keys, None)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=scores.dtype))
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
    out = probs @ mx.expand_dims(v, 2)
    return out.reshape(batch, q_heads, length, v.shape[-1])


# Query block for long causal prefills. On the CPU, attention time is the exp over the
# (L, K) score matrix; blocks of queries see only the keys up to their own end, so the
# masked upper triangle is never computed (about half the work at 2048 tokens).
QUERY_BLOCK = 256


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Mask,
    softcap: float | None = None,
    block: int = QUERY_BLOCK,
) -> mx.array:
    """(B, Hq, L, D) queries over (B, Hkv, K, D) keys/values; Hq a multiple of Hkv.

    The queries are the last L of the K positions (as every cache hands them over).
    On the CPU, prefill-sized causal or unmasked attention runs in the C kernel
    (cpu_kernels.attention); Metal and CUDA keep MLX's fused kernel.
    """
    if softcap is None and (mask is None or isinstance(mask, str)):
        # the CPU primitive (any length, in the graph), else the ctypes kernel (prefill)
        out = cpu_kernels.attend(q, k, v, scale=scale, causal=mask is not None)
        if out is None:
            out = cpu_kernels.attention(q, k, v, scale=scale, causal=mask is not None)
        if out is not None:
            return out
    length, keys = q.shape[2], k.shape[2]
    if length > block and (mask == "causal" or _is_query_key_mask(mask, length, keys)):
        outs = []
        for start in range(0, length, block):
            end = min(start + block, length)
            seen = keys - length + end  # keys before this block's last query, inclusive
            sub = mask if isinstance(mask, str) else mask[..., start:end, :seen]  # type: ignore[index]
            outs.append(
                _attend(q[:, :, start:end], k[:, :, :seen], v[:, :, :seen], scale, sub, softcap)
            )
        return mx.concatenate(outs, axis=2)
    return _attend(q, k, v, scale, mask, softcap)


def cache_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    cache: Cache,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> mx.array:
    """`attention` of (B, Hq, L, D) queries (rotated) over what `cache` holds once it
    has taken these (B, Hkv, L, D) keys and values: a quantized cache's groups are read
    where they are (runtime/models/quantized_attention.py)."""
    if window is None and softcap is None:
        out = _own_rows_attention(q, k, v, cache, scale)
        if out is not None:
            return out
    plan = None
    if softcap is None and cpu_kernels.can_attend(q, k) and v.shape == k.shape:
        plan = _kernel_plan(cache, q.shape[2], window)
    if plan is not None:
        starts, held = plan
        seen_k, seen_v = cache.update_and_fetch(k, v)  # oldest first
        out = cpu_kernels.attend(
            q, seen_k, seen_v, scale=scale, causal=True, starts=starts, window=held
        )
        assert out is not None  # can_attend said it runs
        return out
    mask = cache.make_mask(q.shape[2], window)
    if isinstance(cache, (QuantizedKVCache, BatchQuantizedCache, BatchQuantizedRows)):
        # a batch's mask, without a window, is its rows' padding and causality
        padding = None
        if isinstance(cache, (BatchQuantizedCache, BatchQuantizedRows)) and window is None:
            padding = cache.padding
        keys, values = cache.update_quantized(k, v)
        if softcap is None:
            return quantized_attention(q, keys, values, scale=scale, mask=mask, padding=padding)
        # soft-capped scores: MLX ops
        k, v = keys.dequantize(k.shape[-1]), values.dequantize(v.shape[-1])
    else:
        k, v = cache.update_and_fetch(k, v)
    return attention(q, k, v, scale=scale, mask=mask, softcap=softcap)


def _kernel_plan(
    cache: object, length: int, window: int | None
) -> tuple[list[int] | None, int | None] | None:
    """(each row's first key, the sliding window) for the CPU primitive reading `cache`'s
    keys where they are, with no mask built; None where the mask decides (below).

    A batch's rows (left-padded): each from its first key, past its padding and, in a
    window, what left it (each query its own: decode steps and verify rows get the same
    bits). A sequence's own cache through a window (a prompt chunk, a last token): in
    the kernel whether the window binds or not, so each query's keys and their order are
    the same however the prompt was cut into chunks (the prefix trie's restore points
    move the cuts) and as a batch's step sees them. The kernel takes a window over at
    most DECODE_MAX_LENGTH queries: a longer block whose window binds takes the mask."""
    long = length > cpu_kernels.DECODE_MAX_LENGTH
    if isinstance(cache, BatchTokenCache):
        held = cache.window_of(window)
        if held is not None and long:
            if cache.window_binds(length, held):
                return None
            held = None  # it hides nothing
        return cache.padding, held
    if type(cache) in (KVCache, RotatingKVCache):
        held = cache.max_size if isinstance(cache, RotatingKVCache) else window
        return None if held is None or long else (None, held)
    return None


def _own_rows_attention(
    q: mx.array, k: mx.array, v: mx.array, cache: Cache, scale: float
) -> mx.array | None:
    """A batch's rows in buffers of their own (runtime/cache/rows.py), written and read
    where they are by the CPU primitives: two graph nodes a layer, whatever the rows.
    None where they do not run (the caller's path reads a left-padded copy)."""
    if isinstance(cache, BatchQuantizedRows):
        return rows_attention(q, k, v, cache, scale=scale)
    if not (isinstance(cache, RowTokenCache) and cpu_kernels.can_attend(q, k)):
        return None
    if v.shape != k.shape:
        return None
    cache.extend([k, v], cpu_kernels.append_rows)
    out = cpu_kernels.attend_rows(q, cache.parts[0], cache.parts[1], cache.lengths, scale=scale)
    assert out is not None  # can_attend said it runs
    return out


def rows_layout(model: Any, caches: Sequence[object]) -> bool:
    """Whether a running batch of `model` over `caches` (one per layer) keeps each row's
    keys and values in buffers of its own (runtime/cache/rows.py): where the CPU
    primitives read them there, every full-attention KV layer (plain or quantized)
    attending through `Attention` without a window or soft-capping. Elsewhere (Metal,
    CUDA, no extension) rows pad to the longest: MLX's attention reads one buffer."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    if not cpu_kernels.rows_ready() or len(layers) != len(caches):
        return False
    full = [
        getattr(layer, "self_attn", None)
        for layer, cache in zip(layers, caches, strict=True)
        if type(cache) in (KVCache, QuantizedKVCache)
    ]
    return bool(full) and all(
        isinstance(a, Attention) and a.softcap is None and a.window is None for a in full
    )


def _is_query_key_mask(mask: Mask, length: int, keys: int) -> bool:
    return isinstance(mask, mx.array) and mask.shape[-2:] == (length, keys)


def _attend(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask, softcap: float | None
) -> mx.array:
    if softcap is not None:
        return _softcapped_attention(q, k, v, scale, mask, softcap)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


class Attention(Module):
    """Multi-head attention with grouped KV heads, RoPE and optional per-head q/k norms."""

    def __init__(
        self,
        dims: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RoPE,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: str | None = None,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = Linear(dims, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(dims, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(dims, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(n_heads * head_dim, dims, bias=o_bias)
        if qk_norm is not None:
            unit = qk_norm == "gemma"
            self.q_norm = RMSNorm(head_dim, norm_eps, unit_offset=unit)
            self.k_norm = RMSNorm(head_dim, norm_eps, unit_offset=unit)
        self._qk_norm = qk_norm is not None
        self.rope = rope
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap

    def __call__(self, x: mx.array, cache: Cache | RaggedCache) -> mx.array:
        q, k, v = self.project(x)
        if isinstance(cache, RaggedCache):
            (dq, cq), (dk, ck), (dv, cv) = cache.split(q), cache.split(k), cache.split(v)
            out = cache.join(
                self.attend(dq, dk, dv, cache.decode), self.attend(cq, ck, cv, cache.prefill)
            )
        else:
            out = self.attend(q, k, v, cache)
        return self.o_proj(out)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(B, L, dims) -> queries, keys, values as (B, L, heads, head_dim), q/k normed."""
        batch, length, _ = x.shape
        qkv = fused_products(x, (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = qkv if qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.reshape(batch, length, self.n_heads, self.head_dim)
        k = k.reshape(batch, length, self.n_kv_heads, self.head_dim)
        v = v.reshape(batch, length, self.n_kv_heads, self.head_dim)
        if self._qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: Cache) -> mx.array:
        """Rotary positions, the cache's update and mask, attention: (B, L, heads * dim)."""
        batch, length = q.shape[:2]
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        offset = cache.offset
        q, k = self.rope(q, offset), self.rope(k, offset)
        out = cache_attention(
            q, k, v, cache, scale=self.scale, window=self.window, softcap=self.softcap
        )
        return out.transpose(0, 2, 1, 3).reshape(batch, length, -1)


def fusable(model: Any) -> bool:
    """Whether a decode step and a prefill chunk can run as one forward (RaggedCache):
    every layer attends through `Attention` over a token cache (KV or sliding window).
    (plain or quantized KV, or sliding window). Recurrent and latent layers, which keep
    other state, run their steps apart."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    caches = model.make_caches()
    return all(
        isinstance(getattr(layer, "self_attn", None), Attention) for layer in layers
    ) and all(type(c) in (KVCache, QuantizedKVCache, RotatingKVCache) for c in caches)


def make_layer_caches(layer_types: Sequence[str], sliding_window: int | None) -> list[Cache]:
    """One cache per layer: rotating for sliding-window layers, growing for the rest."""
    caches: list[Cache] = []
    for kind in layer_types:
        if kind == SLIDING_ATTENTION and sliding_window is not None:
            caches.append(RotatingKVCache(max_size=sliding_window))
        else:
            caches.append(KVCache())
    return caches


def tied_logits(embed: Embedding, lm_head: Linear | None, hidden: mx.array) -> mx.array:
    if lm_head is not None:
        return lm_head(hidden)
    # the embeddings as the output layer: on the CPU a decode step's few rows go through
    # the small-GEMM kernel, as every other linear layer's do
    out = cpu_kernels.linear(hidden, embed.weight)
    return embed.as_linear(hidden) if out is None else out


class CausalLM(Module):
    """The shell every architecture shares: a body (`self.model`: embeddings, layers,
    final norm), an LM head or tied embeddings, and one cache per layer."""

    def __init__(self, args: Any, body: Module) -> None:
        super().__init__()
        self.args = args
        self.model = body
        self.lm_head: Linear | None = None
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, tokens: mx.array, caches: Sequence[Cache] | None = None) -> mx.array:
        """(B, L) tokens -> (B, L, hidden) after the final norm; `caches` are updated."""
        with cpu_kernels.steady():
            out: mx.array = self.model(tokens, self.make_caches() if caches is None else caches)
        return out

    def logits(self, hidden: mx.array) -> mx.array:
        with cpu_kernels.steady():
            return tied_logits(self.model.embed_tokens, self.lm_head, hidden)

    def __call__(self, tokens: mx.array, caches: Sequence[Cache] | None = None) -> mx.array:
        return self.logits(self.forward(tokens, caches))

    def make_caches(self) -> list[Cache]:
        return make_layer_caches(self.args.layer_types, self.args.sliding_window)

    def _drop_tied_head(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights


def config_int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key)
    return default if value is None else int(value)


def config_float(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key)
    return default if value is None else float(value)


def optional_float(config: Mapping[str, Any], key: str) -> float | None:
    value = config.get(key)
    return None if value is None else float(value)
