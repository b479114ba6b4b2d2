"""The gated delta-net layer (linear attention) of the hybrid Qwen models (qwen3_next, qwen3_5).

Per value head the layer keeps a state S (head_k_dim x head_v_dim). For each token, with
decay g <= 0 (log space), write strength beta in (0, 1), unit-norm key k, query q:

    S' = exp(g) S;   u = beta (v - S'^T k);   S = S' + k u^T;   out = S^T q

Decode runs that recurrence as written. Prefill runs the equivalent chunked form: within
a chunk of C tokens the u's solve one unit lower-triangular system, so a chunk costs a
few (C x C) and (C x d) matmuls plus one sequential state update (see `delta_rule_chunked`).

Before the delta rule, the q/k/v projection passes a short causal depthwise conv (kernel
`linear_conv_kernel_dim`) whose last kernel-1 inputs are the layer's other state. Both
states live in a RecurrentCache, which the prefix cache snapshots (it cannot rewind).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx.nn.layers.activations import silu, softplus
from mlx.nn.layers.base import Module
from mlx.nn.layers.convolution import Conv1d

from runtime.cache import RecurrentState
from runtime.models.linear import Linear

# Prefill chunk of the parallel form (transformers' and FLA's too). On a 2-core CPU,
# 2048 tokens, 32 heads of 128, 64 measured best (tied with 128 under two BLAS threads;
# 32 is up to 1.4x slower): bench/gated_delta.py compares them.
CHUNK = 64
_L2_EPS = 1e-6  # transformers' (and FLA's) l2norm: x * rsqrt(sum(x^2) + eps)


@dataclass(frozen=True)
class DeltaNetDims:
    """Sizes of one gated delta-net layer (the `linear_*` fields of the config)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: queries, keys and values, in that order."""
        return 2 * self.key_dim + self.value_dim


# -- the delta rule --------------------------------------------------------------------------


def delta_rule_recurrent(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """Token by token. q, k: (B, H, L, Dk); v: (B, H, L, Dv); g, beta: (B, H, L);
    state: (B, H, Dk, Dv). Returns the outputs (B, H, L, Dv) and the final state."""
    outs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t : t + 1]  # (B, H, 1, Dk)
        state = state * mx.exp(g[:, :, t])[..., None, None]
        delta = (v[:, :, t : t + 1] - k_t @ state) * beta[:, :, t, None, None]
        state = state + k_t.swapaxes(-1, -2) @ delta
        outs.append(q[:, :, t : t + 1] @ state)
    return mx.concatenate(outs, axis=2), state


def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular `a` (..., n, n), by block doubling.

    The inverse of a block lower-triangular [[P, 0], [Q, R]] is
    [[P^-1, 0], [-R^-1 Q P^-1, R^-1]]: starting from 1x1 diagonal blocks (all ones),
    each level doubles the block size with two batched matmuls, so log2(n) levels in
    all. Exact block algebra, so it is as stable as forward substitution (a power
    series in `a` would not be: its terms grow combinatorially). Runs on any device.
    """
    n = a.shape[-1]
    size = 1 << max(0, (n - 1).bit_length())
    batch = a.shape[:-2]
    if size != n:  # pad with an identity block, which leaves the top-left inverse alone
        a = mx.pad(a, [(0, 0)] * len(batch) + [(0, size - n), (0, size - n)])
    inv = mx.ones((*batch, size, 1, 1), dtype=a.dtype)
    half = 1
    while half < size:
        count = size // (2 * half)
        blocks = a.reshape(*batch, count, 2 * half, count, 2 * half)
        blocks = mx.moveaxis(mx.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)
        lower_left = blocks[..., half:, :half]  # Q of each diagonal block pair
        pairs = inv.reshape(*batch, count, 2, half, half)
        p_inv, r_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -(r_inv @ lower_left @ p_inv)
        top = mx.concatenate([p_inv, mx.zeros_like(corner)], axis=-1)
        bottom = mx.concatenate([corner, r_inv], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        half *= 2
    return inv.reshape(*batch, size, size)[..., :n, :n]


def delta_rule_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """The same as `delta_rule_recurrent`, a chunk of tokens at a time.

    With G_t the cumulative decay inside a chunk and S0 the state entering it, the
    updates U (C x Dv) satisfy (I + A) U = beta V - beta exp(G) K S0, where
    A[t, s] = beta_t exp(G_t - G_s) k_t.k_s for s < t. So U = W - Kc S0, and both the
    chunk's outputs and the state it hands on are affine in S0: everything but the
    chain of states (one matmul per chunk) is computed for all chunks at once.
    Padding tokens (k = v = 0, g = beta = 0) leave the state alone.
    """
    batch, heads, length, k_dim = k.shape
    size = min(chunk, length)
    pad = -length % size
    if pad:
        seq = [(0, 0), (0, 0), (0, pad)]
        q, k, v = (mx.pad(x, [*seq, (0, 0)]) for x in (q, k, v))
        g, beta = mx.pad(g, seq), mx.pad(beta, seq)
    count = (length + pad) // size
    q, k, v = (x.reshape(batch, heads, count, size, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(batch, heads, count, size), beta.reshape(batch, heads, count, size)

    cum = mx.cumsum(g, axis=-1)  # (B, H, N, C), non-increasing
    causal = mx.tril(mx.ones((size, size), dtype=mx.bool_))
    gap = cum[..., :, None] - cum[..., None, :]  # G_t - G_s
    # masked before exp: above the diagonal the gap is positive and could overflow
    decay = mx.where(causal, mx.exp(mx.where(causal, gap, 0.0)), 0.0)
    k_beta = k * beta[..., None]
    exp_cum = mx.exp(cum)[..., None]
    last = cum[..., -1:]
    # matmuls side by side share one launch: MLX runs a batched matmul as one BLAS call
    # per (batch, head, chunk), so on the CPU the launch count matters as much as flops
    dots = mx.concatenate([k_beta, q], axis=-2) @ k.swapaxes(-1, -2)  # (B, H, N, 2C, C)
    strictly = mx.tril(dots[..., :size, :], k=-1) * decay
    scores = dots[..., size:, :] * decay
    # U = w - k_carry S0, from [w | k_carry] = (I + A)^-1 [beta V | beta exp(G) K]
    carried = unit_lower_inverse(strictly) @ mx.concatenate(
        [v * beta[..., None], k_beta * exp_cum], axis=-1
    )
    v_dim = v.shape[-1]
    # outputs: q exp(G) S0 + scores U = q_eff S0 + scores w
    read = scores @ carried
    local, q_eff = read[..., :v_dim], q * exp_cum - read[..., v_dim:]
    # next state: exp(G_C) S0 + k_to_end U = transition S0 + inject
    k_to_end = (k * mx.exp(last - cum)[..., None]).swapaxes(-1, -2)  # (B, H, N, Dk, C)
    written = k_to_end @ carried
    eye = mx.eye(k_dim, dtype=state.dtype)
    inject = written[..., :v_dim]
    transition = mx.exp(last)[..., None] * eye - written[..., v_dim:]  # (B, H, N, Dk, Dk)

    entering = []
    for i in range(count):  # the only sequential part: one matmul per chunk
        entering.append(state)
        state = mx.addmm(inject[:, :, i], transition[:, :, i], state)
    out = q_eff @ mx.stack(entering, axis=2) + local
    out = out.reshape(batch, heads, count * size, -1)
    return (out[:, :, :length] if pad else out), state


def gated_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """Recurrent form for a decode step, chunked form for anything longer."""
    if q.shape[2] == 1:
        return delta_rule_recurrent(q, k, v, g, beta, state)
    return delta_rule_chunked(q, k, v, g, beta, state, chunk)


# -- the layer -------------------------------------------------------------------------------


def l2_normalize(x: mx.array) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + _L2_EPS)


def causal_conv(x: mx.array, tail: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv of (B, L, C) inputs after the previous `tail` (B, K-1, C)
    inputs; `weight` is (C, K, 1), MLX's grouped Conv1d layout. Returns the outputs and
    the new tail. K shifted multiply-adds: cheaper than a grouped conv for K = 4."""
    kernel = weight.shape[1]
    length = x.shape[1]
    seq = mx.concatenate([tail.astype(x.dtype), x], axis=1)
    taps = weight[:, :, 0].T.astype(x.dtype)  # (K, C)
    out = seq[:, :length] * taps[0]
    for j in range(1, kernel):
        out = out + seq[:, j : j + length] * taps[j]
    # a copy: a view would keep the whole (L + K - 1)-row buffer alive in the cache
    return out, mx.contiguous(seq[:, length:])


class GatedRMSNorm(Module):
    """RMSNorm over each head's outputs, then times silu(gate) (its weight starts at 1)."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x, self.weight, self.eps)
        return (normed * silu(gate.astype(mx.float32))).astype(x.dtype)


class GatedDeltaNet(Module):
    """The linear-attention mixer: q/k/v (through the conv), output gate z, write strength
    b and decay input a from the hidden state; the delta rule; gated norm; out_proj.

    Parameter names follow qwen3_5's checkpoints (in_proj_qkv / _z / _b / _a);
    qwen3_next's fused projections are split into them when loading.
    """

    def __init__(self, dims: DeltaNetDims, chunk: int = CHUNK) -> None:
        super().__init__()
        self.dims = dims
        self.chunk = chunk
        hidden, heads = dims.hidden_size, dims.num_v_heads
        self.in_proj_qkv = Linear(hidden, dims.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, dims.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, heads, bias=False)
        self.in_proj_a = Linear(hidden, heads, bias=False)
        self.conv1d = Conv1d(
            dims.conv_dim, dims.conv_dim, dims.conv_kernel, groups=dims.conv_dim, bias=False
        )
        self.dt_bias = mx.ones((heads,))
        self.A_log = mx.zeros((heads,))
        self.norm = GatedRMSNorm(dims.head_v_dim, dims.norm_eps)
        self.out_proj = Linear(dims.value_dim, hidden, bias=False)

    def _qkv(
        self, x: mx.array, cache: RecurrentState, cuts: Sequence[int] = ()
    ) -> tuple[mx.array, mx.array, mx.array, mx.array, list[mx.array]]:
        """Queries and keys (unit norm, queries scaled, one per value head) and values,
        all (B, Hv, L, D) in float32, the new conv tail, and the conv tails after each of
        the chunk's first `cuts` tokens; the cache is not touched."""
        d = self.dims
        batch, length, _ = x.shape
        tail = cache.conv_state
        if tail is None:
            tail = mx.zeros((batch, d.conv_kernel - 1, d.conv_dim), dtype=x.dtype)
        proj = self.in_proj_qkv(x)
        seen = mx.concatenate([tail.astype(proj.dtype), proj], axis=1) if cuts else proj
        tails = [mx.contiguous(seen[:, b : b + d.conv_kernel - 1]) for b in cuts]
        mixed, tail = causal_conv(proj, tail, self.conv1d.weight)
        mixed = silu(mixed).astype(mx.float32)
        q, k, v = mx.split(mixed, [d.key_dim, 2 * d.key_dim], axis=-1)
        q = l2_normalize(q.reshape(batch, length, d.num_k_heads, d.head_k_dim))
        k = l2_normalize(k.reshape(batch, length, d.num_k_heads, d.head_k_dim))
        q = q * (d.head_k_dim**-0.5)
        group = d.num_v_heads // d.num_k_heads
        if group > 1:  # value heads g*group .. g*group+group-1 read key head g
            q, k = mx.repeat(q, group, axis=2), mx.repeat(k, group, axis=2)
        v = v.reshape(batch, length, d.num_v_heads, d.head_v_dim)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        return q, k, v, tail, tails

    def __call__(self, x: mx.array, cache: RecurrentState) -> mx.array:
        d = self.dims
        batch, length, _ = x.shape
        cuts = cache.cuts(length)
        q, k, v, tail, tails = self._qkv(x, cache, cuts)
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32)).transpose(0, 2, 1)
        a = self.in_proj_a(x).astype(mx.float32) + self.dt_bias.astype(mx.float32)
        g = (-mx.exp(self.A_log.astype(mx.float32)) * softplus(a)).transpose(0, 2, 1)
        state = cache.recurrent_state
        if state is None:
            state = mx.zeros((batch, d.num_v_heads, d.head_k_dim, d.head_v_dim), mx.float32)
        if cuts:
            out, state = self._kept_on_the_way(q, k, v, g, beta, state, cuts, tails, cache)
        else:
            out, state = gated_delta_rule(q, k, v, g, beta, state, self.chunk)
        cache.update(tail, state, length)
        out = out.transpose(0, 2, 1, 3).astype(x.dtype)  # (B, L, Hv, Dv)
        z = self.in_proj_z(x).reshape(batch, length, d.num_v_heads, d.head_v_dim)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(batch, length, d.value_dim))

    def _kept_on_the_way(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        g: mx.array,
        beta: mx.array,
        state: mx.array,
        cuts: Sequence[int],
        tails: Sequence[mx.array],
        cache: RecurrentState,
    ) -> tuple[mx.array, mx.array]:
        """The delta rule a piece at a time, handing the cache (`keep`) the state after
        each of the chunk's first `cuts` tokens: the projections and MLPs of the whole
        chunk still run as one forward."""
        outs, a = [], 0
        for b, conv in zip([*cuts, q.shape[2]], [*tails, None], strict=True):
            qs, ks, vs, gs, bs = (t[:, :, a:b] for t in (q, k, v, g, beta))
            out, state = gated_delta_rule(qs, ks, vs, gs, bs, state, self.chunk)
            outs.append(out)
            if conv is not None:
                cache.keep(b, conv, state)
            a = b
        return mx.concatenate(outs, axis=2), state
