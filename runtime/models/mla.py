"""Multi-head latent attention (MLA: DeepSeek V2/V3 and the models built on them).

Queries come from the hidden state (directly, or through a low-rank `q_a_proj` ->
norm -> `q_b_proj`). Keys and values come from one latent per token: `kv_a_proj_with_mqa`
gives the latent (kv_lora_rank, then normed) and one rotary key shared by all heads
(qk_rope_head_dim); `kv_b_proj` expands the latent into each head's non-rotary key
(qk_nope_head_dim) and value (v_head_dim). The cache keeps only the latent and the
rotary key (runtime/cache/latent.py).

Attention runs in one of two equivalent forms:

- expanded: `kv_b_proj` turns every cached latent into per-head keys and values, then
  ordinary attention. Costs a re-expansion of all T cached tokens per call.
- absorbed: `kv_b_proj`'s key half is folded into the queries (q_nope @ W_uk gives a
  query in latent space) and its value half into the output (latent-space output @ W_uv),
  so attention runs over the cached latents directly, one shared "head" for all queries.
  No expansion, but each query-key pair costs 2 * kv_lora_rank + rope_dim instead of
  qk_head_dim + v_head_dim.

`use_absorbed` picks by counting multiply-adds (bench/mla_prefill.py measures both):
decode steps and short chunks absorb, long prefill chunks expand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.quantized import QuantizedLinear

from runtime import kernels as cpu_kernels
from runtime.cache import LatentCache, Mask, window_mask
from runtime.models.base import RMSNorm, attention, config_int
from runtime.models.linear import Linear
from runtime.models.rope import RoPE, RopeSpec, parse_rope

# transformers and DeepSeek's own code build q_a_layernorm / kv_a_layernorm with the
# RMSNorm default, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """The attention's dimensions, from a HF config dict (`from_config`)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope: RopeSpec
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale: 1/sqrt(qk_head_dim), times YaRN's mscale(all dims) squared
        (DeepSeek's long-context correction, applied whenever the rope is scaled)."""
        scale = self.qk_head_dim**-0.5
        spec = self.rope
        if spec.rope_type != "default" and spec.mscale_all_dim:
            mscale = _yarn_mscale(spec.factor, spec.mscale_all_dim)
            scale *= mscale * mscale
        return scale

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> MLAConfig:
        q_lora = config.get("q_lora_rank")
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_heads=int(config["num_attention_heads"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            attention_bias=bool(config.get("attention_bias", False)),
            rope=_mla_rope(config),
            # DeepSeek's checkpoints lay rotary pairs out interleaved; transformers'
            # default, and what configs written before the switch existed mean
            rope_interleave=bool(config.get("rope_interleave", True)),
        )


def _mla_rope(config: Mapping[str, Any]) -> RopeSpec:
    """The rope spec; a YaRN without `factor` takes max_position / original, as
    transformers does for DeepSeek configs."""
    spec = parse_rope(config)
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if spec.rope_type == "yarn" and params.get("factor") is None:
        max_pos = config_int(config, "max_position_embeddings", 4096)
        spec = replace(spec, factor=max_pos / spec.original_max_position_embeddings)
    return spec


class InterleavedRoPE(RoPE):
    """RoPE over interleaved pairs (x0, x1), (x2, x3), ... (`traditional` in MLX terms).

    transformers de-interleaves the rotated result; that permutes the rotary dims of
    queries and keys alike, so their dot products, all attention sees, are the same.
    """

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        if self._mscale != 1.0:
            x = x * mx.array(self._mscale, dtype=x.dtype)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=True,
            base=self._base,
            scale=self._scale,
            offset=offset,
            freqs=self._freqs,
        )


def make_rope(cfg: MLAConfig) -> RoPE:
    rope_cls = InterleavedRoPE if cfg.rope_interleave else RoPE
    return rope_cls(cfg.rope, cfg.qk_rope_head_dim)


def use_absorbed(cfg: MLAConfig, length: int, keys: int) -> bool:
    """Whether attending `length` queries to `keys` cached tokens costs fewer multiply-adds
    absorbed than expanded (causal halving affects both forms alike, so it is ignored)."""
    heads, rank = cfg.num_heads, cfg.kv_lora_rank
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    expanded = keys * rank * (nope + v) + length * keys * (nope + rope + v)
    absorbed = length * rank * (nope + v) + length * keys * (2 * rank + rope)
    return heads * absorbed <= heads * expanded


class MultiLatentAttention(Module):
    """MLA over a LatentCache; parameter names are transformers'."""

    # its weight is read a head's rows at a time (`_head_weights`): kept in mx.quantize's
    # layout (runtime/models/linear.py `use_lanes`)
    reads_weights = ("kv_b_proj",)

    def __init__(self, cfg: MLAConfig, rope: RoPE) -> None:
        super().__init__()
        self.cfg = cfg
        heads, bias = cfg.num_heads, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(
            cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * cfg.v_head_dim, cfg.hidden_size, bias=bias)
        self.rope = rope
        self.scale = cfg.scale
        # None: choose per call by cost (use_absorbed); True/False forces a form (tests)
        self.absorb: bool | None = None

    def _queries(self, x: mx.array) -> mx.array:
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        batch, length, _ = x.shape
        return q.reshape(batch, length, self.cfg.num_heads, -1).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, cache: LatentCache) -> mx.array:
        cfg = self.cfg
        batch, length, _ = x.shape
        q = self._queries(x)
        q_nope, q_rot = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(x)[:, None]  # (B, 1, L, rank + rope)
        latent = self.kv_a_layernorm(kv[..., : cfg.kv_lora_rank])
        offset = cache.offset
        q_rot = self.rope(q_rot, offset)
        k_rot = self.rope(kv[..., cfg.kv_lora_rank :], offset)
        mask = cache.make_mask(length)
        latents, rope_keys = cache.update_and_fetch(latent, k_rot)
        absorb = self.absorb
        if absorb is None:
            absorb = use_absorbed(cfg, length, latents.shape[2])
        if absorb:
            out = self._absorbed(q_nope, q_rot, latents, rope_keys, mask)
        else:
            out = self._expanded(q_nope, q_rot, latents, rope_keys, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def _expanded(
        self, q_nope: mx.array, q_rot: mx.array, latents: mx.array, rope_keys: mx.array, mask: Mask
    ) -> mx.array:
        cfg = self.cfg
        batch, heads, _, _ = q_nope.shape
        keys = latents.shape[2]
        kv = self.kv_b_proj(latents[:, 0]).reshape(batch, keys, heads, -1).transpose(0, 2, 1, 3)
        k_nope, values = kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim :]
        shared = mx.broadcast_to(rope_keys, (batch, heads, keys, cfg.qk_rope_head_dim))
        k = mx.concatenate([k_nope, shared], axis=-1)
        q = mx.concatenate([q_nope, q_rot], axis=-1)
        pad = cfg.qk_head_dim - cfg.v_head_dim
        if pad > 0 and q.shape[2] >= cpu_kernels.MIN_ROWS and cpu_kernels.kernels() is not None:
            # the CPU kernel wants values as wide as keys; zero columns cost less than
            # MLX's attention (2.6x at 2k tokens, 16 heads of 192/128)
            zeros = mx.zeros((*values.shape[:-1], pad), dtype=values.dtype)
            values = mx.concatenate([values, zeros], axis=-1)
            return attention(q, k, values, scale=self.scale, mask=mask)[..., : cfg.v_head_dim]
        return attention(q, k, values, scale=self.scale, mask=mask)

    def _absorbed(
        self, q_nope: mx.array, q_rot: mx.array, latents: mx.array, rope_keys: mx.array, mask: Mask
    ) -> mx.array:
        batch, heads, length, _ = q_nope.shape
        keys = latents.shape[2]
        scale = mx.array(self.scale, dtype=q_nope.dtype)
        # every head's queries against the one shared latent "head": a single matmul each
        q_latent = (self._fold_keys(q_nope) * scale).reshape(batch, 1, heads * length, -1)
        q_rot = (q_rot * scale).reshape(batch, 1, heads * length, -1)
        scores = q_latent @ latents.swapaxes(-1, -2) + q_rot @ rope_keys.swapaxes(-1, -2)
        scores = scores.reshape(batch, heads, length, keys)
        if mask is not None:
            allowed = window_mask(length, keys, None) if isinstance(mask, str) else mask
            scores = mx.where(allowed, scores, mx.array(-mx.inf, dtype=scores.dtype))
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(latents.dtype)
        out = probs.reshape(batch, 1, heads * length, keys) @ latents
        return self._unfold_values(out.reshape(batch, heads, length, -1))

    def _head_weights(self, part: str) -> tuple[mx.array, ...]:
        """kv_b_proj's key ("k") or value ("v") rows as (heads, rows, rank) arrays: the
        weight, plus scales and biases when it is quantized."""
        cfg = self.cfg
        layer = self.kv_b_proj
        rows = slice(0, cfg.qk_nope_head_dim) if part == "k" else slice(cfg.qk_nope_head_dim, None)
        arrays = [layer.weight]
        if isinstance(layer, QuantizedLinear):
            arrays += [layer.scales] + ([] if layer.biases is None else [layer.biases])
        return tuple(a.reshape(cfg.num_heads, -1, a.shape[-1])[:, rows] for a in arrays)

    def _fold_keys(self, q_nope: mx.array) -> mx.array:
        """(B, H, L, nope) queries -> (B, H, L, rank): q_nope @ W_uk per head."""
        return self._per_head(q_nope, self._head_weights("k"), transpose=False)

    def _unfold_values(self, out: mx.array) -> mx.array:
        """(B, H, L, rank) latent-space outputs -> (B, H, L, v_head_dim): out @ W_uv^T."""
        return self._per_head(out, self._head_weights("v"), transpose=True)

    def _per_head(self, x: mx.array, arrays: tuple[mx.array, ...], *, transpose: bool) -> mx.array:
        layer = self.kv_b_proj
        if isinstance(layer, QuantizedLinear):
            weight, scales, *biases = arrays
            return cpu_kernels.qmatmul(
                x,
                weight,
                scales,
                biases[0] if biases else None,
                transpose=transpose,
                group_size=layer.group_size,
                bits=layer.bits,
                mode=layer.mode,
            )
        (weight,) = arrays
        return x @ (weight.swapaxes(-1, -2) if transpose else weight)


def fuse_absorbed_weights(weights: dict[str, mx.array], cfg: MLAConfig) -> dict[str, mx.array]:
    """mlx-lm's split of kv_b_proj, as mlx-community folders store it, back into
    ``kv_b_proj.weight``: ``embed_q`` (heads, rank, nope) and ``unembed_out``
    (heads, v, rank). Quantized halves are dequantized first (affine; bits and group size
    follow from the shapes): they are quantized along other axes than kv_b_proj would be.
    """
    out = dict(weights)
    for name in [n for n in weights if n.endswith(".embed_q.weight")]:
        prefix = name[: -len(".embed_q.weight")]
        keys = _float_weight(out, f"{prefix}.embed_q", cfg.qk_nope_head_dim)
        values = _float_weight(out, f"{prefix}.unembed_out", cfg.kv_lora_rank)
        fused = mx.concatenate([keys.swapaxes(-1, -2), values], axis=1)
        out[f"{prefix}.kv_b_proj.weight"] = fused.reshape(-1, cfg.kv_lora_rank)
    return out


def _float_weight(weights: dict[str, mx.array], module: str, in_dims: int) -> mx.array:
    """Pop `module`'s weight (and its scales and biases), dequantized if quantized."""
    weight = weights.pop(f"{module}.weight")
    scales = weights.pop(f"{module}.scales", None)
    biases = weights.pop(f"{module}.biases", None)
    if scales is None:
        return weight
    bits = weight.shape[-1] * 32 // in_dims
    group_size = in_dims // scales.shape[-1]
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
