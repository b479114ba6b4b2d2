"""Tiny random BERT-family encoders saved as sentence-transformers folders: a transformers
model (the oracle), a word-piece tokenizer.json, and modules.json / 1_Pooling /
sentence_bert_config.json, so sentence-transformers and our loader read the same folder.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from runtime.batch import open_handle
from runtime.engine import EncoderRunner, EncoderSettings
from runtime.types import Encoded, EncodeRequest

VOCAB = 1024
HIDDEN = 64
MAX_SEQ_LENGTH = 48
WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "for",
    "with",
    "and",
    "or",
    "not",
    "is",
    "are",
    "was",
    "be",
    "this",
    "that",
    "it",
    "as",
    "at",
    "by",
    "from",
    "model",
    "models",
    "vector",
    "vectors",
    "search",
    "memory",
    "agent",
    "agents",
    "query",
    "document",
    "documents",
    "rank",
    "rerank",
    "score",
    "scores",
    "text",
    "texts",
    "token",
    "tokens",
    "embed",
    "embedding",
    "embeddings",
    "fast",
    "slow",
    "cat",
    "dog",
    "fox",
    "bird",
    "fish",
    "tree",
    "river",
    "mountain",
    "city",
    "road",
    "car",
    "train",
    "plane",
    "ship",
    "sun",
    "moon",
    "star",
    "light",
    "dark",
    "red",
    "green",
    "blue",
    "small",
    "large",
    "old",
    "new",
    "good",
    "bad",
    "first",
    "last",
    "one",
    "two",
    "three",
]

_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")


def _vocab(specials: Sequence[str]) -> dict[str, int]:
    pieces = list(specials) + list(dict.fromkeys(WORDS))
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,!?'-")
    pieces += [p for p in letters if p not in pieces]
    pieces += [f"##{p}" for p in letters]
    pieces += [f"##{w}" for w in WORDS[:50]]
    vocab: dict[str, int] = {}
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    return vocab


def wordpiece(roberta: bool = False) -> Tokenizer:
    """A lower-casing word-piece tokenizer with BERT's (or RoBERTa's) special tokens and
    post-processor: [CLS] A [SEP] B [SEP] (or <s> A </s></s> B </s>)."""
    specials = _ROBERTA_SPECIALS if roberta else _BERT_SPECIALS
    unk = specials[3] if roberta else "[UNK]"
    vocab = _vocab(specials)
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if roberta:
        cls, sep = ("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])
        tok.post_processor = processors.RobertaProcessing(sep, cls)
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
    tok.add_special_tokens(list(specials))
    return tok


def transformers_model(kind: str, *, labels: int = 0, seed: int = 0) -> Any:
    """A tiny random `kind` (bert, roberta, xlm-roberta) model in eval mode; with
    `labels`, its *ForSequenceClassification."""
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 66 if kind != "bert" else 64,
    }
    if labels:
        common["num_labels"] = labels
    if kind == "bert":
        config: Any = transformers.BertConfig(**common)
        cls: Any = transformers.BertForSequenceClassification if labels else transformers.BertModel
    elif kind == "roberta":
        config = transformers.RobertaConfig(**common, type_vocab_size=1, pad_token_id=1)
        cls = transformers.RobertaForSequenceClassification if labels else transformers.RobertaModel
    else:
        config = transformers.XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=1)
        cls = (
            transformers.XLMRobertaForSequenceClassification
            if labels
            else transformers.XLMRobertaModel
        )
    model = cls(config)
    # random weights are small: scale the embeddings up so the layers see varied inputs
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "word_embeddings" in name:
                param.mul_(20.0)
    return model.eval()


def save_encoder(
    folder: Path,
    kind: str = "bert",
    *,
    pooling: Sequence[str] = ("mean",),
    normalize: bool = True,
    labels: int = 0,
    seed: int = 0,
    max_seq_length: int = MAX_SEQ_LENGTH,
) -> Any:
    """Write a tiny `kind` encoder folder (an embedding model with sentence-transformers'
    files, or with `labels` a cross-encoder); returns the transformers model."""
    model = transformers_model(kind, labels=labels, seed=seed)
    model.save_pretrained(folder)
    roberta = kind != "bert"
    wordpiece(roberta).save(str(folder / "tokenizer.json"))
    cls, pad, sep, unk, mask = (
        ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
        if roberta
        else ("[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]")
    )
    names = {"cls_token": cls, "pad_token": pad, "sep_token": sep, "unk_token": unk}
    names["mask_token"] = mask
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_length,
        **names,
    }
    if not roberta:  # BERT's tokenizers hand the model token types (a pair's 0s and 1s)
        tokenizer_config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if labels:
        return model
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    keys = {
        "cls": "pooling_mode_cls_token",
        "mean": "pooling_mode_mean_tokens",
        "max": "pooling_mode_max_tokens",
        "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
        "lasttoken": "pooling_mode_lasttoken",
    }
    config: dict[str, Any] = {"word_embedding_dimension": HIDDEN}
    config.update({key: name in pooling for name, key in keys.items()})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    bert_config = {"max_seq_length": max_seq_length, "do_lower_case": False}
    (folder / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return model


def run_encoder(loaded: Any, inputs: Sequence[Any], *, piece_tokens: int = 2048) -> Any:
    """One encode request through an EncoderRunner stepped on this thread: its values
    (numpy, one row per input)."""
    runner = EncoderRunner(loaded, EncoderSettings(piece_tokens=piece_tokens, cache_entries=0))
    handle = open_handle(EncodeRequest.of(tuple(inputs)))
    runner.admit(handle)
    while True:
        for done_handle, done in runner.step():
            if done_handle is handle:
                assert isinstance(done, Encoded), done
                return done.values
