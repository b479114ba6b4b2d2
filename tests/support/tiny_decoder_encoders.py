"""Tiny random Qwen3 embedding models and rerankers as HF folders (and GGUF files): a
transformers model (the oracle), a byte-level BPE tokenizer.json built like Qwen3's
(NFC, Qwen2's split, byte-level; trained here on a small corpus so "yes" and "no" are
single tokens), and for an embedding model the files Qwen3-Embedding ships for
sentence-transformers (modules.json, 1_Pooling with last-token pooling, Normalize; its
tokenizer appends <|endoftext|>).

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import torch
import transformers
from gguf import MODEL_ARCH, GGUFWriter, PoolingType, get_tensor_name_map
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from runtime.load.decoder_encoder import RERANKER_PROMPT
from tests.support.tiny_encoders import WORDS

HIDDEN = 64
MAX_SEQ_LENGTH = 40
EOT = "<|endoftext|>"
SPECIALS = (EOT, "<|im_start|>", "<|im_end|>", "<think>", "</think>")
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NORMAL, CONTROL = 1, 3


def bpe(*, append_eos: bool) -> Tokenizer:
    """A Qwen3-like byte-level BPE tokenizer; `append_eos`: Qwen3-Embedding's
    post-processor (every input ends with <|endoftext|>), else Qwen3's (adds nothing)."""
    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS)] * 4 + ["yes no yes no", "Yes, no."] * 8
    corpus += [RERANKER_PROMPT.prefix + RERANKER_PROMPT.template + RERANKER_PROMPT.suffix] * 3
    trainer = BpeTrainer(
        vocab_size=600, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    if append_eos:
        eot = tok.token_to_id(EOT)
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A:0 {EOT}:0", pair=f"$A:0 {EOT}:0 $B:1 {EOT}:1", special_tokens=[(EOT, eot)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    return tok


def transformers_model(kind: str, vocab: int, *, seed: int = 0, tied: bool = True) -> Any:
    """A tiny random Qwen3 `kind` ("embed": Qwen3Model, "seq-cls":
    Qwen3ForSequenceClassification with one label, "causal": Qwen3ForCausalLM), eval."""
    torch.manual_seed(seed)
    settings: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": HIDDEN, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied, "pad_token_id": 0, "num_labels": 1,
    }  # fmt: skip
    config = transformers.Qwen3Config(**settings)
    cls = {
        "embed": transformers.Qwen3Model,
        "seq-cls": transformers.Qwen3ForSequenceClassification,
        "causal": transformers.Qwen3ForCausalLM,
    }[kind]
    model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # spread the weights: norms off 1, varied projections
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.config._attn_implementation = "eager"
    return model.eval()


def save_embedder(folder: Path, *, seed: int = 0, append_eos: bool = True) -> Any:
    """A Qwen3-Embedding-like folder (Qwen3Model weights without a `model.` prefix, as
    it ships); returns the transformers model."""
    tok = bpe(append_eos=append_eos)
    model = transformers_model("embed", tok.get_vocab_size(), seed=seed)
    _save(folder, model, tok)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True,
    }  # fmt: skip
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    bert_config = {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False}
    (folder / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return model


def save_reranker(folder: Path, kind: str, *, seed: int = 0, tied: bool = True) -> Any:
    """A Qwen3-Reranker-like folder: `kind` "causal" (the original, a causal LM) or
    "seq-cls" (a Qwen3ForSequenceClassification conversion); returns the model."""
    tok = bpe(append_eos=False)
    model = transformers_model(kind, tok.get_vocab_size(), seed=seed, tied=tied)
    _save(folder, model, tok)
    return model


def _save(folder: Path, model: Any, tok: Tokenizer) -> None:
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": EOT,
        "padding_side": "left", "model_max_length": 200,
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_gguf(folder: Path, path: Path, *, pooling_type: int | None = 3) -> None:
    """The folder as llama.cpp's converter writes a qwen3 embedding model (pooling 3,
    last token) or reranker (4, rank: the LM head's yes and no rows as cls.output):
    F32 tensors under gguf-py's names, the `qwen3.*` keys, a gpt2 vocabulary. None: no
    pooling type (a chat model's file)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    layers = int(config["num_hidden_layers"])
    writer = GGUFWriter(str(path), "qwen3")
    writer.add_block_count(layers)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config["num_key_value_heads"]))
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_key_length(int(config["head_dim"]))
    writer.add_value_length(int(config["head_dim"]))
    if pooling_type is not None:
        writer.add_pooling_type(PoolingType(pooling_type))
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    _vocabulary(writer, tok, eos_appended=pooling_type == 3)
    names = get_tensor_name_map(MODEL_ARCH.QWEN3, layers)
    vocab_ids = tok["model"]["vocab"]
    for name, value in weights.items():
        full = name if name.startswith(("model.", "lm_head.")) else f"model.{name}"
        stem, _, kind = full.rpartition(".")
        data = np.ascontiguousarray(np.asarray(value.astype(mx.float32)))
        head = "model.embed_tokens" if config.get("tie_word_embeddings") else "lm_head"
        if pooling_type == 4 and stem == head:
            rows = data[[vocab_ids["yes"], vocab_ids["no"]]]
            writer.add_tensor("cls.output.weight", np.ascontiguousarray(rows))
            if stem == "lm_head":
                continue
        writer.add_tensor(f"{names.get_name(stem)}.{kind}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _vocabulary(writer: GGUFWriter, tok: dict[str, Any], *, eos_appended: bool) -> None:
    vocab: dict[str, int] = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    size = max([*vocab.values(), *added.values()]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [NORMAL] * size
    for piece, i in vocab.items():
        tokens[i] = piece
    for piece, i in added.items():
        tokens[i], types[i] = piece, CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    # the converter takes the eos from the post-processor's trailing token when there is one
    writer.add_eos_token_id(added[EOT] if eos_appended else added["<|im_end|>"])
    writer.add_pad_token_id(added[EOT])
    writer.add_bos_token_id(added[EOT])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(eos_appended)
