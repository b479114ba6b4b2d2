"""A BERT embedding model folder written as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes one (checked against that script's output for
all-MiniLM-L6-v2): gguf-py's tensor names, the `bert.*` keys, and the vocabulary
respelled (a word-initial piece gets a leading ▁, a continuation piece loses its ##)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize as reference_quantize

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def _vocabulary(folder: Path, size: int) -> tuple[list[str], list[int], dict[str, int]]:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [USER_DEFINED] * size
    for piece, i in vocab.items():
        if piece in special:
            tokens[i], types[i] = piece, CONTROL
        else:
            tokens[i] = piece[2:] if piece.startswith("##") else f"▁{piece}"
            types[i] = NORMAL
    return tokens, types, vocab


def write_bert_gguf(
    folder: Path, path: Path, *, quant: QT | None = None, pooling_type: int = 1
) -> None:
    """`folder` (config.json, model.safetensors, tokenizer.json) as a GGUF at `path`:
    F32 tensors, or `quant` for the 2-D weights."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    layers = int(config["num_hidden_layers"])
    writer = GGUFWriter(str(path), "bert")
    writer.add_block_count(layers)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-12)))
    writer.add_causal_attention(False)
    writer.add_uint32("bert.pooling_type", pooling_type)
    tokens, types, vocab = _vocabulary(folder, int(config["vocab_size"]))
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(vocab["[CLS]"])
    writer.add_eos_token_id(vocab["[SEP]"])
    writer.add_sep_token_id(vocab["[SEP]"])
    writer.add_unk_token_id(vocab["[UNK]"])
    writer.add_pad_token_id(vocab["[PAD]"])
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", True)
    names = get_tensor_name_map(MODEL_ARCH.BERT, layers)
    for name, value in weights.items():
        stem, _, kind = name.removeprefix("bert.").rpartition(".")
        if stem.startswith("pooler") or kind in ("position_ids", "token_type_ids"):
            continue  # the converter leaves them out
        data = np.asarray(value.astype(mx.float32))
        gguf_name = f"{names.get_name(stem)}.{kind}"
        if quant is not None and data.ndim == 2 and "embeddings" not in stem:
            writer.add_tensor(gguf_name, reference_quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
