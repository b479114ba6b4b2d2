"""GGUF-built tokenizers (runtime.load.gguf.tokenizer): synthetic metadata, and real
GGUF files against the reference tokenizer.json of the same family (ids and decoding on a
hard corpus)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from runtime.load.gguf.reader import GGUFFile
from runtime.load.gguf.tokenizer import (
    CONTROL,
    NORMAL,
    USER_DEFINED,
    build_hf_tokenizer,
    tokenizer_from_gguf,
)
from runtime.text.tokenizer import Tokenizer

# Text that trips tokenizers up: unicode of many scripts, emoji sequences, code,
# whitespace runs, numbers, contractions.
CORPUS = (
    "Hello, world! How are you today?",
    "  leading spaces and trailing spaces   ",
    "multiple     spaces\tand\ttabs\n\nnewlines\r\nwindows line\r\n",
    "Café naïve résumé façade coöperate — “quotes” ‘single’ … ellipsis",
    "decomposed: e\u0301 a\u0300 n\u0303 (NFD) vs é à ñ",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "العربية: مرحبا بالعالم",
    "emoji 😀 👍🏽 👩‍👩‍👧‍👦 🏳️‍🌈 🇺🇸🇯🇵 ❤️",
    "def foo(x):\n\tif x > 0:\n\t\treturn x * 2\n    else:\n        return None  \n",
    "class A:\n    def __init__(self):\n        self.x = [1, 2, 3]  # comment\n",
    "numbers 1234567890 3.14159 -42 1e10 0x1F 2024-01-01 1,000,000",
    "   \n   \n\t \t",
    "x" * 50 + " " + "ab" * 30,
    "don't won't I'm you're they've we'll he'd IT'S",
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "Ünïcödé ÀÉÎÕÜ ßẞ ﬁ ligature Ⅻ ½ ²",
    "a\n\n\n\nb\n\n\n\n\n\n\nc",
    "",
    " ",
    "\n",
)


def _non_ascii_numeric(text: str) -> bool:
    return any(not ch.isascii() and ch.isnumeric() for ch in text)


# -- GGUF tokenizers from synthetic metadata ---------------------------------------------------


def _spm_metadata(add_space_prefix: bool) -> dict[str, Any]:
    pieces = ["<unk>", "<s>", "</s>", "<start>", "\n\n"]
    types = [2, CONTROL, CONTROL, CONTROL, USER_DEFINED]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    normal = ["▁", "a", "b", "c", "ab", "▁a", "▁ab", "abc", "▁abc", "bc"]
    pieces += normal
    types += [NORMAL] * len(normal)
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.array([-float(i) for i in range(len(pieces))], np.float32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def test_sentencepiece_from_metadata_merges_and_byte_fallback() -> None:
    meta = _spm_metadata(add_space_prefix=True)
    tok = tokenizer_from_gguf(meta)
    hf = tok.hf
    pieces = [hf.id_to_token(i) for i in tok.encode("abc ab", add_special_tokens=False)]
    assert pieces == ["▁abc", "▁ab"]
    # unknown characters fall back to their UTF-8 bytes
    ids = tok.encode("é", add_special_tokens=False)
    assert [hf.id_to_token(i) for i in ids] == ["▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "é"
    assert tok.decode(tok.encode("abc ab")) == "abc ab"
    # control tokens are matched whole and hidden; user-defined ones matched and shown
    ids = tok.encode("ab<start>\n\nab", add_special_tokens=False)
    assert 3 in ids and 4 in ids
    assert tok.special_ids >= {1, 2, 3} and 4 not in tok.special_ids
    assert tok.add_bos is True  # SentencePiece default when the file does not say
    assert tok.encode("ab")[0] == 1


def test_sentencepiece_without_space_prefix() -> None:
    tok = tokenizer_from_gguf(_spm_metadata(add_space_prefix=False))
    pieces = [tok.hf.id_to_token(i) for i in tok.encode("ab abc", add_special_tokens=False)]
    assert pieces == ["ab", "▁abc"]
    assert tok.decode(tok.encode(" ab")) == " ab"


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="not supported"):
        build_hf_tokenizer({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


# -- real GGUF files against their families' reference tokenizers ------------------------------


@pytest.fixture(scope="module")
def qwen25_pair(qwen25_gguf: Path, qwen3_tokenizer_dir: Path) -> tuple[Tokenizer, HFTokenizer]:
    return (
        tokenizer_from_gguf(GGUFFile(qwen25_gguf)),
        HFTokenizer.from_file(str(qwen3_tokenizer_dir / "tokenizer.json")),
    )


@pytest.fixture(scope="module")
def gemma3_pair(gemma3_gguf: Path, gemma3_tokenizer_dir: Path) -> tuple[Tokenizer, HFTokenizer]:
    return (
        tokenizer_from_gguf(GGUFFile(gemma3_gguf)),
        HFTokenizer.from_file(str(gemma3_tokenizer_dir / "tokenizer.json")),
    )


def _assert_same_ids(ours: Tokenizer, ref: HFTokenizer, texts: tuple[str, ...]) -> None:
    for text in texts:
        expected = ref.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == ref.decode(
            expected, skip_special_tokens=False
        ), text


@pytest.mark.real_model
def test_qwen25_gguf_tokenizer_matches_reference(
    qwen25_pair: tuple[Tokenizer, HFTokenizer],
) -> None:
    ours, ref = qwen25_pair
    chat = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    _assert_same_ids(ours, ref, (*CORPUS, chat, "<tool_call>\n{}\n</tool_call>"))
    for text in CORPUS:
        # the Qwen normalizer composes (NFC) before encoding
        assert ours.decode(ours.encode(text)) == unicodedata.normalize("NFC", text)
    assert (ours.bos_token, ours.eos_token, ours.add_bos) == ("<|endoftext|>", "<|im_end|>", False)
    assert ours.encode_prompt(chat)[0] == ref.token_to_id("<|im_start|>")
    im_end = ref.token_to_id("<|im_end|>")
    assert im_end in ours.eos_token_ids and im_end in ours.special_ids
    assert ours.decode(ours.encode(chat)) == "system\nYou are helpful.\nuser\nhi\n"


@pytest.mark.real_model
def test_gemma3_gguf_tokenizer_matches_reference(
    gemma3_pair: tuple[Tokenizer, HFTokenizer],
) -> None:
    ours, ref = gemma3_pair
    chat = "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n"
    _assert_same_ids(ours, ref, (*CORPUS, chat))
    for text in CORPUS:
        assert ours.decode(ours.encode(text)) == text
    assert (ours.bos_token, ours.bos_token_id, ours.add_bos) == ("<bos>", 2, True)
    assert ours.encode("hi")[0] == 2
    assert ours.encode_prompt("<bos>" + chat).count(2) == 1
    assert ours.encode_prompt(chat)[0] == 2


@pytest.mark.real_model
def test_smollm2_gguf_tokenizer_matches_transformers(smollm2_gguf: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    ).backend_tokenizer
    ours = tokenizer_from_gguf(GGUFFile(smollm2_gguf))
    chat = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    # transformers splits "Ⅻ ½ ²" with GPT-2's regex; llama.cpp's smollm pre-tokenizer
    # (and SmolLM's own tokenizer.json) isolate every \p{N} character, as we do.
    texts = tuple(t for t in CORPUS if not _non_ascii_numeric(t))
    _assert_same_ids(ours, ref, (*texts, chat))
    for text in CORPUS:
        assert ours.decode(ours.encode(text)) == text
    pieces = [ours.id_to_token(i) for i in ours.encode("x 2024 ½")]
    assert pieces == ["x", "Ġ", "2", "0", "2", "4", "Ġ", "Â½"]
    assert (ours.bos_token, ours.eos_token, ours.add_bos) == ("<|im_start|>", "<|im_end|>", False)


@pytest.mark.real_model
def test_llama3_bpe_metadata_matches_reference(llama3_tokenizer_dir: Path) -> None:
    """Llama 3 files say tokenizer.ggml.pre = "llama-bpe": rebuild the GGUF metadata
    llama.cpp would write from the official tokenizer.json and compare encodings."""
    data = json.loads((llama3_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    added = {t["id"]: t["content"] for t in data["added_tokens"]}
    size = max([*vocab.values(), *added]) + 1
    tokens = [""] * size
    for text, index in vocab.items():
        tokens[index] = text
    for index, text in added.items():
        tokens[index] = text
    types = np.array([CONTROL if i in added else NORMAL for i in range(size)], dtype=np.int32)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 128000,
        "tokenizer.ggml.eos_token_id": 128009,
        "tokenizer.ggml.add_bos_token": True,
    }
    ours = tokenizer_from_gguf(meta)
    ref = HFTokenizer.from_file(str(llama3_tokenizer_dir / "tokenizer.json"))
    chat = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    _assert_same_ids(ours, ref, (*CORPUS, chat))
    assert ours.encode("hi") == ref.encode("hi").ids  # BOS added the same way
    assert ours.eos_token_ids == frozenset({128009})
