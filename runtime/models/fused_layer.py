"""A llama-style layer's decode step as one CPU primitive (runtime/kernels/ext/layer.cpp).

Built of separate primitives, a decoder layer's step over a running batch is about two
dozen graph nodes: the norms, the q/k/v products and their reshapes and transposes, two
rotations, the rows' writes, attention, the output product, two residual adds, the MLP.
On a CPU each node costs a few microseconds of MLX's scheduling and of Python building
it: Qwen2.5-Coder-0.5B's step is about 600 nodes, 2 ms of Python and several of
scheduling around 14 ms of kernels. `layer_step` runs the same kernels in the same order
as one node, with the same bits (tests/runtime/models/test_fused_layer.py).

It applies to a `PreNormBlock` of `Attention` (no window, no soft-capping; optional q/k
RMSNorms) and the gated `MLP` (silu or tanh-gelu), every product quantized (affine), the
norms RMSNorm, over a running batch's rows in buffers of their own (RowTokenCache, float32)
with up to SMALL_ROWS tokens in all (decode steps and speculative verify rows). Anything
else, and MLX_GATEWAY_CPU_LAYER=0, runs the separate primitives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from runtime import kernels as cpu_kernels
from runtime.cache import RowTokenCache
from runtime.models.base import MLP, Attention, RMSNorm
from runtime.models.linear import packed
from runtime.models.rope import RoPE

# the kernels' names of the gated activations the primitive applies
_ACTIVATIONS = ("silu", "gelu_tanh")
_UNREAD = object()


@dataclass(frozen=True)
class LayerShape:
    """What a layer's step needs besides its arrays (read once per layer)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    unit_offset: bool
    qk_eps: float  # < 0: no q/k norms
    rope_dims: int
    rope_scale: float
    mscale: float
    scale: float
    activation: str


def _shape(layer: Any) -> LayerShape | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    n1 = getattr(layer, "input_layernorm", None)
    n2 = getattr(layer, "post_attention_layernorm", None)
    if type(attn) is not Attention or type(mlp) is not MLP:
        return None
    if type(n1) is not RMSNorm or type(n2) is not RMSNorm or type(attn.rope) is not RoPE:
        return None
    if (
        attn.window is not None
        or attn.softcap is not None
        or mlp.kernel_activation not in _ACTIVATIONS
    ):
        return None
    if n1.eps != n2.eps or n1.unit_offset != n2.unit_offset:
        return None
    qk_eps = -1.0
    if "q_norm" in attn:
        qn, kn = attn.q_norm, attn.k_norm
        if not (type(qn) is RMSNorm and type(kn) is RMSNorm and qn.eps == kn.eps):
            return None
        if qn.unit_offset != n1.unit_offset or kn.unit_offset != n1.unit_offset:
            return None
        qk_eps = float(qn.eps)
    rope = attn.rope.kernel_args()
    if rope is None:
        return None
    dims, scale, mscale = rope
    return LayerShape(
        attn.n_heads, attn.n_kv_heads, attn.head_dim, float(n1.eps), bool(n1.unit_offset),
        qk_eps, dims, scale, mscale, float(attn.scale), str(mlp.kernel_activation),
    )  # fmt: skip


def _linears(layer: Any) -> tuple[Any, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return (
        attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
        mlp.gate_proj, mlp.up_proj, mlp.down_proj,
    )  # fmt: skip


def _arguments(layer: Any, shape: LayerShape) -> tuple[Any, ...] | None:
    """The primitive's array arguments before the rows (norms, the products' lists, the
    rotation's frequencies): kept beside the layer while its products are the same."""
    attn = layer.self_attn
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if shape.qk_eps >= 0:
        norms += [attn.q_norm.weight, attn.k_norm.weight]
    products = tuple(packed(p) for p in _linears(layer))
    key = (*products, *norms)
    held = layer.__dict__.get("_step_arguments")
    if held is not None and all(a is b for a, b in zip(held[0], key, strict=True)):
        return held[1]
    parts = [p for p in products if p is not None]
    if len(parts) != len(products):
        return None
    args = (
        norms, [p.w for p in parts], [p.scales for p in parts], [p.biases for p in parts],
        [p.bias for p in parts], [p.group_size for p in parts], [p.bits for p in parts],
        attn.rope.inv_freq(),
    )  # fmt: skip
    object.__setattr__(layer, "_step_arguments", (key, args))
    return args


def layer_step(layer: Any, x: mx.array, cache: object) -> mx.array | None:
    """`layer(x, cache)` for a `PreNormBlock` as one primitive (the module docstring),
    the cache's rows written; None where it does not apply (the caller runs the layer's
    modules)."""
    if not isinstance(cache, RowTokenCache) or cache.width != 2 or x.ndim != 3:
        return None
    sw = cpu_kernels.switches()
    ext = sw.ext
    if ext is None or not sw.layer or not hasattr(ext, "decoder_layer"):
        return None
    batch, length, _ = x.shape
    if x.dtype != mx.float32 or batch != cache.rows or batch * length > cpu_kernels.SMALL_ROWS:
        return None
    if any(a.dtype != mx.float32 for part in cache.parts for a in part):
        return None
    held = layer.__dict__.get("_step_shape", _UNREAD)
    if held is _UNREAD:  # read once per layer, kept beside its parameters
        held = _shape(layer)
        object.__setattr__(layer, "_step_shape", held)
    if not isinstance(held, LayerShape):
        return None
    shape = held
    args = _arguments(layer, shape)
    if args is None:
        return None
    offsets = cache.offset
    hidden: list[mx.array] = []

    def write(rows: list[list[mx.array]], ends: list[int]) -> list[list[mx.array]]:
        outs: list[mx.array] = ext.decoder_layer(
            x, *args, offsets, rows[0], rows[1], ends,
            heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
            eps=shape.eps, unit_offset=shape.unit_offset, qk_eps=shape.qk_eps,
            rope_dims=shape.rope_dims, rope_scale=shape.rope_scale, mscale=shape.mscale,
            scale=shape.scale, activation=shape.activation, threads=sw.threads,
            generic=sw.generic, small_rows=cpu_kernels.SMALL_ROWS, x_bits=sw.x_bits,
        )  # fmt: skip
        hidden.append(outs[0])
        return [outs[1 : 1 + batch], outs[1 + batch :]]

    cache.write_with(length, write)
    return hidden[0]
