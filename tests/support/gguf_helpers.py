"""Writing GGUF files the way llama.cpp's converter does (for loader tests), and logits
helpers for comparing our models with transformers'."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter, get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize as reference_quantize

from runtime.load.loaded import LoadedModel

TOKENS = np.array([[5, 17, 3, 99, 42, 7, 250, 11, 64, 1, 2, 300, 8, 9, 10, 77]])
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original": 8192}


def tokenizer_metadata(writer: GGUFWriter, vocab: int) -> None:
    letters = [chr(c) for c in range(0x21, 0x7F)]
    tokens = [*letters, "ab", *(f"<t{i}>" for i in range(vocab - len(letters) - 3))]
    tokens += ["<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", vocab - 1)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")


def write_gguf(
    path: Path, arch: str, hf_model: Any, meta: dict[str, Any], quant: QT | None = None
) -> None:
    """What convert_hf_to_gguf.py does for these architectures, with F32 tensors
    (or ``quant`` for the 2-D weights), names from gguf-py's own tensor map."""
    cfg = hf_model.config
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    tokenizer_metadata(writer, cfg.vocab_size)
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, _, kind = name.rpartition(".")
        data = tensor.float().numpy()
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if "q_proj" in stem else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        gguf_name = f"{name_map.get_name(stem)}.{kind}"
        if quant is not None and data.ndim == 2:
            writer.add_tensor(gguf_name, reference_quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def randomize(model: Any, seed: int = 0) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.08)
    model.eval()


def torch_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)))
    return np.asarray(out.logits.float().numpy())


def our_logits(loaded: LoadedModel, tokens: np.ndarray) -> np.ndarray:
    out = loaded.model(mx.array(tokens), loaded.model.make_caches())
    return np.array(out.astype(mx.float32))


def llama_cpp_rope_freqs(theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.1 rope scaling (the converter's loop)."""
    factors = []
    low_wavelen = LLAMA3["original"] / LLAMA3["low_freq_factor"]
    high_wavelen = LLAMA3["original"] / LLAMA3["high_freq_factor"]
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(LLAMA3["factor"])
        else:
            smooth = (LLAMA3["original"] / wavelen - LLAMA3["low_freq_factor"]) / (
                LLAMA3["high_freq_factor"] - LLAMA3["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / LLAMA3["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def append_rope_freqs(path: Path, freqs: np.ndarray) -> None:
    reader = GGUFReader(str(path))
    writer = GGUFWriter(str(path) + ".tmp", "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype.name == "ARRAY":
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor("rope_freqs.weight", freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(path) + ".tmp").replace(path)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF "rotate half" -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
