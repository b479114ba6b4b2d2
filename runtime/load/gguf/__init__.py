"""GGUF files: the reader, and the config, weights and tokenizer built from one."""

from __future__ import annotations

from runtime.load.gguf.config import hf_config
from runtime.load.gguf.loader import gguf_generation_config, load_gguf
from runtime.load.gguf.reader import GGUFFile
from runtime.load.gguf.tokenizer import build_hf_tokenizer, tokenizer_from_gguf

__all__ = [
    "GGUFFile",
    "build_hf_tokenizer",
    "gguf_generation_config",
    "hf_config",
    "load_gguf",
    "tokenizer_from_gguf",
]
