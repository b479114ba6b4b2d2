"""Llama (and llama-architecture models such as SmolLM2): optional attention/MLP bias."""

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
        return cls.parse(config, qkv_bias=bias, o_bias=bias, default_max_positions=2048)


class Model(DecoderModel):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
