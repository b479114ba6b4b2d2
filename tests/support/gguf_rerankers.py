"""A tiny cross-encoder folder (tests/support/tiny_encoders.py, `labels=1`) written as a
GGUF file the way llama.cpp's convert_hf_to_gguf.py writes one (checked key by key and
tensor by tensor against that script's output for these tiny bert and roberta folders):
architecture bert whatever the body, `bert.classifier.output_labels`, no pooling type;
BERT's pooler left out and its classifier written as `cls.output`; RoBERTa's
classifier.dense as `cls` and classifier.out_proj as `cls.output`, its position table
without the padding_idx + 1 rows before the first position; the vocabulary as the
converter keeps it (a BERT one respelled for llama.cpp's WordPiece, a RoBERTa one as
gpt2 pieces)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map

NORMAL, CONTROL, UNUSED = 1, 3, 5
_HEAD = {"classifier.dense": "cls", "classifier.out_proj": "cls.output"}


def _tokens(folder: Path, size: int, bert: bool) -> tuple[list[str], list[int], dict[str, int]]:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    # the slots past the tokenizer's vocabulary: "[PAD<i>]", unused (and, not being
    # control tokens, respelled like any other BERT word)
    spell = "▁" if bert else ""
    tokens, types = [f"{spell}[PAD{i}]" for i in range(size)], [UNUSED] * size
    for piece, i in vocab.items():
        if piece in special:
            tokens[i], types[i] = piece, CONTROL
        elif bert:
            tokens[i] = piece[2:] if piece.startswith("##") else f"▁{piece}"
        else:
            tokens[i] = piece
        if piece not in special:
            types[i] = NORMAL
    return tokens, types, vocab


def write_cross_encoder_gguf(folder: Path, path: Path) -> None:
    """The bert or roberta cross-encoder in `folder` as an F32 GGUF at `path`."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    bert = config["model_type"] == "bert"
    offset = 0 if bert else int(config["pad_token_id"]) + 1
    layers = int(config["num_hidden_layers"])
    writer = GGUFWriter(str(path), "bert")
    writer.add_block_count(layers)
    writer.add_context_length(int(config["max_position_embeddings"]) - offset)
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
    writer.add_causal_attention(False)
    writer.add_classifier_output_labels([v for _, v in sorted(config["id2label"].items())])
    tokens, types, vocab = _tokens(folder, int(config["vocab_size"]), bert)
    writer.add_token_type_count(int(config["type_vocab_size"]))
    writer.add_tokenizer_model("bert" if bert else "gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    specials = ("[CLS]", "[SEP]", "[UNK]", "[PAD]") if bert else ("<s>", "</s>", "<unk>", "<pad>")
    writer.add_bos_token_id(vocab[specials[0]])
    writer.add_eos_token_id(vocab[specials[1]])
    writer.add_sep_token_id(vocab[specials[1]])
    writer.add_unk_token_id(vocab[specials[2]])
    writer.add_pad_token_id(vocab[specials[3]])
    writer.add_mask_token_id(vocab["[MASK]" if bert else "<mask>"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(not bert)
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", True)
    names = get_tensor_name_map(MODEL_ARCH.BERT, layers)
    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    for name, value in weights.items():
        stem, _, kind = name.removeprefix("bert.").removeprefix("roberta.").rpartition(".")
        if stem.startswith("pooler") or kind in ("position_ids", "token_type_ids"):
            continue  # the converter leaves the pooler out, a classifier's too
        data = np.ascontiguousarray(np.asarray(value.astype(mx.float32)))
        if stem == "embeddings.position_embeddings":
            data = data[offset:]
        gguf_name = "cls.output" if stem == "classifier" and bert else _HEAD.get(stem)
        writer.add_tensor(f"{gguf_name or names.get_name(stem)}.{kind}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
