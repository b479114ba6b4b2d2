"""Qwen2 / Qwen2.5: biases on q/k/v (not o), tied or untied embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.models.decoder import DecoderArgs, DecoderModel


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        return cls.parse(config, qkv_bias=True, o_bias=False, default_max_positions=32768)


class Model(DecoderModel):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
