"""Qwen3 (dense): per-head RMSNorm on queries and keys before RoPE; head_dim from config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.models.decoder import DecoderArgs, DecoderModel


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        bias = bool(config.get("attention_bias", False))
        return cls.parse(
            config,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            default_head_dim=128,
            default_max_positions=32768,
        )


class Model(DecoderModel):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
