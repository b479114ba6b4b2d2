"""Load a GGUF file: config, weights (any quant type), tokenizer and chat template all
from the one file (the dtype policy: runtime/load/loader.py's docstring)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runtime.load.gguf.config import hf_config
from runtime.load.gguf.names import convert_weights
from runtime.load.gguf.reader import GGUFFile
from runtime.load.gguf.tokenizer import tokenizer_from_gguf
from runtime.load.loaded import (
    LoadedModel,
    ShardHook,
    context_length,
    end_of_turn_ids,
    finish_model,
    quantize_modules,
    resolve_dtype,
)
from runtime.models import build_model
from runtime.text import token_ids

# gguf-py's Keys.General.SAMPLING_* (written by convert_hf_to_gguf.py from
# generation_config.json) -> generation_config.json's own names
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def load_gguf(
    path: Path, dtype: str | None, keep_quantized: bool, shard: ShardHook | None = None
) -> LoadedModel:
    """A GGUF file as a LoadedModel (``load``'s arguments: runtime/load/loader.py)."""
    gf = GGUFFile(path)
    config = hf_config(gf)
    default = None
    if keep_quantized:
        default = "float32" if gf.architecture.startswith("gemma") else "float16"
    dtype_name, mx_dtype = resolve_dtype(dtype, default)
    # The tokenizer build is mostly Python (GIL-bound) and the weight conversion mostly
    # numpy (GIL-free): overlapping them hides most of the tokenizer's time.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(tokenizer_from_gguf, gf)
        converted = convert_weights(gf, config, dtype=mx_dtype, keep_quantized=keep_quantized)
        tokenizer = pending.result()
    model = build_model(config)
    if converted.quantization:
        quantize_modules(model, converted.quantization)
    finish_model(model, converted.weights, shard)
    template = gf.get("tokenizer.chat_template")
    generation = gguf_generation_config(gf.metadata)
    # A GGUF names one eos id; chat turns end with the vocabulary's end-of-turn token
    # (a base model without a template may still be prompted in its chat format).
    eos = set(tokenizer.eos_token_ids) | set(token_ids(config.get("eos_token_id")))
    eos.update(end_of_turn_ids(tokenizer))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        chat_template=str(template) if template else None,
        eos_token_ids=frozenset(eos),
        name=path.stem,
        source=path,
        context_length=context_length(config),
        quantized=bool(converted.quantization),
        dtype=dtype_name,
        generation_config=generation,
    )


def gguf_generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling a GGUF's metadata recommends, named as in generation_config.json."""
    out: dict[str, Any] = {}
    for key, name in _GGUF_SAMPLING.items():
        value = metadata.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out
