"""The cache of a multi-head latent attention layer (DeepSeek V2/V3, Kimi K2, GLM-4.7-Flash).

MLA keys and values are projections of one small per-token latent, so the cache holds
that latent (after its norm) and the single rotary key every head shares, not per-head
keys and values: (B, 1, T, kv_lora_rank) and (B, 1, T, qk_rope_head_dim). For DeepSeek
V3 that is 576 numbers a token against 40,960 for expanded K/V (128 heads x (192 + 128)).

Both are token-indexed arrays like a KV cache's keys and values, so the growing buffer,
rewinding, trimming and paging (delta snapshots of positions [base, end), merge, split)
are exactly KVCache's; `keys` hold the latents and `values` the rotary keys.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.cache.kv import KVCache


class LatentCache(KVCache):
    """Latents and shared rotary keys of every token seen (see the module docstring)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (B, 1, L, kv_lora_rank) latents and (B, 1, L, rope_dim) rotary keys;
        return all held so far."""
        if keys.shape[1] != 1 or values.shape[1] != 1:
            raise ValueError("a latent cache holds one shared latent and rotary key a token")
        return super().update_and_fetch(keys, values)

    @property
    def latents(self) -> mx.array | None:
        """The held latents, (B, 1, offset, kv_lora_rank)."""
        return None if self.keys is None else self.keys[..., : self.offset, :]

    @property
    def rope_keys(self) -> mx.array | None:
        """The held rotary keys, (B, 1, offset, qk_rope_head_dim)."""
        return None if self.values is None else self.values[..., : self.offset, :]
