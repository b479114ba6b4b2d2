"""GGUF byte-level tokenizers of the DeepSeek, GLM and Kimi families split text as the
models' own tokenizers do; an unknown ``tokenizer.ggml.pre`` is refused.

The oracle for each ``tokenizer.ggml.pre`` name is a ``tokenizers.Tokenizer`` loaded from a
tokenizer.json whose pre_tokenizer section is pasted from the original model's file (non-ASCII
written as JSON escapes, so no look-alike character can creep in). Both sides share one small
BPE vocabulary, trained with a coarse split so that it holds merges across digits, letters,
punctuation and CJK; a wrong split then shows up in the ids as well as in the pieces.

Kimi-K2 ships tiktoken, not a tokenizer.json: its oracle is its split regex applied by the
``regex`` package with ``V1`` (class intersection ``&&``), then BPE on each piece alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import regex
from gguf import GGUFWriter
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from runtime.load.gguf.reader import GGUFFile
from runtime.load.gguf.tokenizer import (
    CONTROL,
    NORMAL,
    USER_DEFINED,
    build_hf_tokenizer,
    tokenizer_from_gguf,
)

_SPLIT = '"behavior": "Isolated", "invert": false'
_BYTE_LEVEL = (
    '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}'
)

# deepseek-ai/deepseek-llm-7b-base, DeepSeek-V2(-Lite), DeepSeek-V2.5: tokenizer.json.
DEEPSEEK_LLM = (
    r'{"type": "Sequence", "pretokenizers": ['
    r'{"type": "Split", "pattern": {"Regex": "[\r\n]"}, ' + _SPLIT + "}, "
    r'{"type": "Split", "pattern": {"Regex": "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6'
    r"\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    r"\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    r"\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    r"\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    r"\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    r"\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    r"\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126"
    r"\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    r"\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    r"\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    r"\uff21-\uff3a\uff41-\uff5a\ud801\udc00-\ud801\udc4f\ud801\udcb0-\ud801\udcd3"
    r"\ud801\udcd8-\ud801\udcfb\ud803\udc80-\ud803\udcb2\ud803\udcc0-\ud803\udcf2"
    r'\ud806\udca0-\ud806\udcdf\ud83a\udd00-\ud83a\udd43]+"}, ' + _SPLIT + "}, "
    r'{"type": "Split", "pattern": {"Regex": "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e'
    r'\u2018-\u201f\u3000-\u3002]+"}, ' + _SPLIT + "}, "
    r'{"type": "Split", "pattern": {"Regex": "\\s+$"}, ' + _SPLIT + "}, "
    r'{"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"}, '
    + _SPLIT
    + "}, "
    r'{"type": "Digits", "individual_digits": true}, ' + _BYTE_LEVEL + "]}"
)

# deepseek-ai/deepseek-coder-6.7b-base: tokenizer.json.
DEEPSEEK_CODER = (
    r'{"type": "Sequence", "pretokenizers": ['
    r'{"type": "Split", "pattern": {"Regex": "[\r\n]"}, ' + _SPLIT + "}, "
    r'{"type": "Split", "pattern": {"Regex": "\\s?\\p{L}+"}, ' + _SPLIT + "}, "
    r'{"type": "Split", "pattern": {"Regex": "\\s?\\p{P}+"}, ' + _SPLIT + "}, "
    r'{"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"}, '
    + _SPLIT
    + "}, "
    r'{"type": "Digits", "individual_digits": true}, ' + _BYTE_LEVEL + "]}"
)

# deepseek-ai/DeepSeek-V3 (and R1, V3.1): tokenizer.json.
DEEPSEEK_V3 = (
    r'{"type": "Sequence", "pretokenizers": ['
    r'{"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, ' + _SPLIT + "}, "
    r'{"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}, '
    + _SPLIT
    + "}, "
    r'{"type": "Split", "pattern": {"Regex": "[!\"#$%&'
    r"'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    r'| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, '
    + _SPLIT
    + "}, "
    + _BYTE_LEVEL
    + "]}"
)

# GLM-4 / GLM-4.5 / 4.6 / 4.7: tiktoken's cl100k pattern, converted to tokenizer.json.
GLM4 = (
    r'{"type": "Sequence", "pretokenizers": ['
    r'{"type": "Split", "pattern": {"Regex": "(?i:'
    r"'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    r'| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, '
    + _SPLIT
    + "}, "
    + _BYTE_LEVEL
    + "]}"
)

# tokenizer.ggml.pre -> (the original pre_tokenizer, the original BPE's ignore_merges)
FAMILIES: dict[str, tuple[str, bool]] = {
    "deepseek-llm": (DEEPSEEK_LLM, False),
    "deepseek-coder": (DEEPSEEK_CODER, False),
    "deepseek-v3": (DEEPSEEK_V3, False),
    "glm4": (GLM4, True),
    "chatglm-bpe": (GLM4, True),
}
ARCH = {
    "deepseek-llm": "deepseek2",
    "deepseek-coder": "deepseek2",
    "deepseek-v3": "deepseek2",
    "glm4": "glm4moe",
    "chatglm-bpe": "chatglm",
    "kimi-k2": "deepseek2",
}

# moonshotai/Kimi-K2-Instruct tokenization_kimi.py: pat_str, its alternatives as written.
KIMI_K2 = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

SPECIAL = "<｜end▁of▁sentence｜>"
# In the vocabulary with no merge that builds it: only whole-piece lookup (ignore_merges,
# as tiktoken does) finds it.
WHOLE = "zqxjk"

CORPUS = (
    "Hello, world! How are you today?",
    "numbers 1234567 12 123 1234 3.14159 -42 1e10 0x1F 2024-01-01 1,000,000 ½ ² Ⅻ ٣٤٥",
    "中文文本测试，你好世界。日本語のテキスト、カタカナとひらがな。한국어 텍스트 입니다",
    "mixed中文English混合 abc你好 123你好 ＡＢＣ full-width ！？",
    "don't won't I'm you're they've we'll he'd IT'S 'quoted' O'Neil",
    "punctuation!!! ??? ... --- *** ((nested)) [[x]] {{y}} <<>> ~~ @@ ## $$ %% ^^",
    "a\n\n\n\nb\r\nc\rd\n  \n\t\tindented\n",
    "  leading and trailing spaces   ",
    "emoji 😀 👍🏽 👩‍👩‍👧‍👦 🏳️‍🌈 🇺🇸🇯🇵 ❤️",
    "Café naïve résumé Ünïcödé ÀÉÎÕÜ ßẞ ﬁ “quotes” ‘single’ … — ¿qué?",
    # Greek Extended and letter-like symbols whose NFC forms are other code points
    "Ελληνικά \u1f7d \u1fd3 \u1fdb \u1fbe \u2126 \u212a \u212b ℂℍ 𐐀𐐨 "
    "Русский текст, العربية, עברית, हिन्दी, ไทย",
    "a[b]c^d_e`f\\g \u212a[x] \u1f7d^ \u1fbe_",
    "def foo(x):\n\tif x > 0:\n\t\treturn x * 2  # comment\n    else:\n        return None\n",
    'const s = `${a}+${b}`; let m = {"k": [1, 2, 3]}; x->y && y||z != 0; cd ~/src; a!~b',
    f"a word BPE cannot build\n{WHOLE}",
    "\u00a0non-breaking\u2003em-space\u200bzero-width\u3000ideographic",
    "x" * 40 + " " + "ab" * 20 + " " + "9" * 25,
    "<｜end▁of▁sentence｜>after special",
    "",
    " ",
    "\n",
)

# Where Kimi-K2's split differs from gpt-4o's and cl100k's: Han runs beside kana, Latin,
# marks and digits; case runs; contractions in any case; Han-script Lm / Nl characters.
KIMI_CORPUS = (
    "Kimi中文English混合のテキスト、カタカナ漢字とひらがな。abc你好123你好 한국어텍스트",
    "HelloWorld getHTTPResponse XMLHttpRequest iPhone McDonald's ÉCOLE École ǅungla",
    "DON'T don't Don'T I'M i'm YOU'RE They'Ve WE'LL he'D IT's 中文's 日本'S x'\n's",
    "1234567890 12 123 1234 ٣٤٥٦٧ ①②③④ 一二三四 3.14159 x2024年1月1日",
    "!!!\n\n??? ...\r\n--- ***\n\n\n((x)) 。，！\n 「引用」 ——",
    "a    b  \n   c   \t\t  \n\n  d\u3000\u3000e   ",
    "e\u0301cole nai\u0308ve \u03a9\u0301 \u4e2d\u0301\u6587 x\u0308\u0301 \u0301\u0301",
    "emoji 😀 👍🏽 👩‍👩‍👧‍👦 🇯🇵 ❤️ 中😀文 ab😀cd",
    "々〇〻 ヶ月 ーー 乄 人々 〇〇年 𠀀𠀁abc 豈更 ⺀⼀",
    " 中文 中文  中文\n中文",
)

# Splits words with their leading space only, so the vocabulary learns merges that
# cross the families' boundaries (digit runs, letter-punctuation, CJK-Latin).
_TRAIN_SPLIT = r" ?[^\s]+|\s+"


def _vocabulary() -> tuple[dict[str, int], list[str]]:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_TRAIN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [text for text in (*CORPUS, *KIMI_CORPUS) if WHOLE not in text]
    tok.train_from_iterator([*texts, *texts[:6]], trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    vocab = dict(model["vocab"])
    assert WHOLE not in vocab
    vocab[WHOLE] = len(vocab)
    return vocab, merges


@pytest.fixture(scope="module")
def vocabulary() -> tuple[dict[str, int], list[str]]:
    return _vocabulary()


def _oracle(
    pre_tokenizer: str, ignore_merges: bool, vocab: dict[str, int], merges: list[str]
) -> HFTokenizer:
    """A tokenizer.json as the model ships it, with this test's vocabulary."""
    spec: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": len(vocab),
                "content": SPECIAL,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": json.loads(pre_tokenizer),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return HFTokenizer.from_str(json.dumps(spec))


def _write_gguf(path: Path, pre: str, vocab: dict[str, int], merges: list[str]) -> Path:
    """The tokenizer metadata llama.cpp's converter writes for a byte-level vocabulary."""
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda item: item[1])] + [SPECIAL]
    types = [NORMAL] * (len(tokens) - 1) + [CONTROL]
    writer = GGUFWriter(str(path), ARCH[pre])
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.eos_token_id", len(tokens) - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pieces(tok: HFTokenizer, text: str) -> list[str]:
    assert tok.pre_tokenizer is not None
    return [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(FAMILIES))
def test_gguf_splits_and_ids_match_the_original_tokenizer_json(
    pre: str, vocabulary: tuple[dict[str, int], list[str]], tmp_path: Path
) -> None:
    vocab, merges = vocabulary
    spec, ignore_merges = FAMILIES[pre]
    oracle = _oracle(spec, ignore_merges, vocab, merges)
    path = _write_gguf(tmp_path / f"{pre}.gguf", pre, vocab, merges)
    meta = GGUFFile(path).metadata
    hf = build_hf_tokenizer(meta)
    ours = tokenizer_from_gguf(meta)
    for text in CORPUS:
        assert _pieces(hf, text.replace(SPECIAL, "")) == _pieces(oracle, text.replace(SPECIAL, ""))
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == oracle.encode(text).ids, text
        if SPECIAL not in text:
            assert ours.decode(ids) == text


@pytest.mark.parametrize("pre", sorted(FAMILIES))
def test_corpus_tells_each_family_from_gpt2(
    pre: str, vocabulary: tuple[dict[str, int], list[str]]
) -> None:
    """The corpus is hard enough that GPT-2's split (no tokenizer.ggml.pre) fails on it."""
    vocab, merges = vocabulary
    oracle = _oracle(FAMILIES[pre][0], FAMILIES[pre][1], vocab, merges)
    gpt2 = build_hf_tokenizer(
        {"tokenizer.ggml.tokens": list(vocab), "tokenizer.ggml.merges": merges}
    )
    assert any(_pieces(oracle, t) != _pieces(gpt2, t) for t in CORPUS)


_KIMI_TEXTS = (*KIMI_CORPUS, *(text.replace(SPECIAL, "") for text in CORPUS))


def test_kimi_k2_splits_as_tiktoken_does() -> None:
    """Oniguruma applies the `&&` class intersections as the regex package's V1 does."""
    hf = build_hf_tokenizer({"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.pre": "kimi-k2"})
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in _KIMI_TEXTS:
        expected = [
            spell.pre_tokenize_str(piece)[0][0]
            for piece in regex.findall(KIMI_K2, text, flags=regex.V1)
        ]
        assert _pieces(hf, text) == expected, text


def test_kimi_k2_corpus_tells_it_from_gpt2_and_gpt4o() -> None:
    tokens = {"tokenizer.ggml.tokens": ["a"]}
    kimi = build_hf_tokenizer({**tokens, "tokenizer.ggml.pre": "kimi-k2"})
    for other in ("gpt2", "gpt-4o"):
        hf = build_hf_tokenizer({**tokens, "tokenizer.ggml.pre": other})
        assert any(_pieces(kimi, t) != _pieces(hf, t) for t in KIMI_CORPUS), other


def test_kimi_k2_gguf_encodes_like_tiktoken(
    vocabulary: tuple[dict[str, int], list[str]], tmp_path: Path
) -> None:
    """A byte-level Kimi-K2 GGUF through the loader: each regex piece is BPE-encoded on
    its own, whole pieces in the vocabulary first, as tiktoken does."""
    vocab, merges = vocabulary
    piece_bpe = _oracle(
        '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, '
        '"use_regex": false}',
        True,
        vocab,
        merges,
    )
    path = _write_gguf(tmp_path / "kimi-k2.gguf", "kimi-k2", vocab, merges)
    ours = tokenizer_from_gguf(GGUFFile(path))
    for text in (*_KIMI_TEXTS, f"see\n{WHOLE}"):
        expected = [
            i
            for piece in regex.findall(KIMI_K2, text, flags=regex.V1)
            for i in piece_bpe.encode(piece).ids
        ]
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == expected, text
        assert ours.decode(ids) == text
    assert vocab[WHOLE] in ours.encode(f"see\n{WHOLE}", add_special_tokens=False)


def test_unknown_pre_is_refused() -> None:
    """Another split gives other ids: a wrong model. llama.cpp refuses the file too."""
    tokens = [chr(c) for c in range(0x21, 0x7F)]
    meta: dict[str, Any] = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.pre": "no-such-pre"}
    with pytest.raises(ValueError, match="no-such-pre") as excinfo:
        build_hf_tokenizer(meta)
    message = str(excinfo.value)
    assert "kimi-k2" in message and "deepseek-v3" in message  # the known names
    assert "newer mlx-gateway" in message and "tokenizer.json" in message
    with pytest.raises(ValueError, match="no-such-pre"):
        tokenizer_from_gguf(meta)


def test_default_or_missing_pre_splits_like_gpt2() -> None:
    tokens = [chr(c) for c in range(0x21, 0x7F)]
    missing = build_hf_tokenizer({"tokenizer.ggml.tokens": tokens})
    default = build_hf_tokenizer({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.pre": "default"})
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    text = "numbers 1234567, don't stop!!\n\n 中文  "
    expected = [piece for piece, _ in gpt2.pre_tokenize_str(text)]
    assert _pieces(missing, text) == _pieces(default, text) == expected


@pytest.mark.real_model
def test_deepseek_v3_metadata_matches_reference(deepseek_v3_tokenizer_dir: Path) -> None:
    """The real DeepSeek-V3 vocabulary as llama.cpp writes it (pre "deepseek-v3") encodes
    like the model's own tokenizer.json."""
    data = json.loads((deepseek_v3_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    added = {t["id"]: t for t in data["added_tokens"]}
    size = max([*vocab.values(), *added]) + 1
    tokens = [""] * size
    for text, index in vocab.items():
        tokens[index] = text
    for index, token in added.items():
        tokens[index] = token["content"]
    types = np.array(
        [
            NORMAL if i not in added else CONTROL if added[i]["special"] else USER_DEFINED
            for i in range(size)
        ],
        dtype=np.int32,
    )
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    meta = {
        "general.architecture": "deepseek2",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "deepseek-v3",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    ours = tokenizer_from_gguf(meta)
    ref = HFTokenizer.from_file(str(deepseek_v3_tokenizer_dir / "tokenizer.json"))
    for text in CORPUS:
        assert (
            ours.encode(text, add_special_tokens=False)
            == ref.encode(text, add_special_tokens=False).ids
        ), text
