"""Tokenizers: our wrapper's BOS/EOS conventions, and a HF-style folder's tokenizer and
chat template. (GGUF-built tokenizers: tests/runtime/load/test_gguf_tokenizer.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from runtime.text.tokenizer import Tokenizer, read_chat_template, token_ids

# -- the wrapper, on small hand-built tokenizers ----------------------------------------------


def _word_tokenizer() -> HFTokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|end|>": 3, "hello": 4, "world": 5}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<|end|>")])
    return tok


def _write_folder(folder: Path, config: dict[str, Any], **extra: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _word_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, data in extra.items():
        (folder / f"{name}.json").write_text(json.dumps(data))
    return folder


def test_folder_tokenizer_bos_and_eos(tmp_path: Path) -> None:
    folder = _write_folder(
        tmp_path,
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True},
        generation_config={"eos_token_id": [2, 3]},
    )
    tok = Tokenizer.from_folder(folder)
    assert (tok.bos_token, tok.bos_token_id, tok.add_bos) == ("<s>", 1, True)
    assert tok.eos_token == "</s>"
    assert tok.eos_token_ids == frozenset({2, 3})
    assert tok.special_ids == frozenset({1, 2, 3})
    assert tok.encode("hello world") == [1, 4, 5]
    assert tok.encode("hello world", add_special_tokens=False) == [4, 5]
    # a rendered prompt that already starts with BOS gets no second one
    assert tok.encode_prompt("<s> hello") == [1, 4]
    assert tok.encode_prompt("hello") == [1, 4]
    assert tok.decode([1, 4, 5, 2]) == "hello world"
    assert tok.decode([1, 4], skip_special_tokens=False) == "<s> hello"
    assert tok.id_to_token(5) == "world"
    assert tok.id_to_token(999) is None
    assert tok.vocab_size == 6


def test_folder_tokenizer_without_bos_flag_follows_post_processor(tmp_path: Path) -> None:
    from tokenizers import processors

    folder = _write_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>"})
    assert Tokenizer.from_folder(folder).add_bos is False
    hf = _word_tokenizer()
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_folder(folder)
    assert tok.add_bos is True
    assert tok.encode("hello") == [1, 4]  # once, not from both the wrapper and the hf side


def test_folder_tokenizer_special_tokens_map(tmp_path: Path) -> None:
    folder = _write_folder(
        tmp_path, {}, special_tokens_map={"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    )
    tok = Tokenizer.from_folder(folder)
    assert (tok.bos_token, tok.eos_token, tok.add_bos) == ("<s>", "</s>", False)


def test_chat_template_sources(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    folder = _write_folder(tmp_path, config)
    assert read_chat_template(folder) == "D"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "S"}))
    assert read_chat_template(folder) == "S"
    (folder / "chat_template.jinja").write_text("J")
    assert read_chat_template(folder) == "J"
    (tmp_path / "empty").mkdir()
    assert read_chat_template(tmp_path / "empty") is None


def test_token_ids_of_a_config_field() -> None:
    """eos_token_id as config.json and generation_config.json write it."""
    assert token_ids(2) == [2]
    assert token_ids([1, True, "x", 3]) == [1, 3]
    assert token_ids(True) == [] and token_ids(None) == [] and token_ids("2") == []
