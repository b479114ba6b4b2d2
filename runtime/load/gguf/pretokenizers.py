"""How a GGUF byte-level vocabulary splits text before BPE, chosen by ``tokenizer.ggml.pre``.

A ``gpt2`` GGUF gives its tokens (in the GPT-2 byte alphabet) and merges, but not how text
is split before BPE; llama.cpp names that split, and each name here mirrors the original
``tokenizer.json`` of that family: one or several regex splits, maybe a one-digit-per-piece
split, then the byte alphabet (Qwen2 also normalizes to NFC). An unknown name is refused,
as llama.cpp does: another split gives other ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# Split regexes of the byte-level families, as in their tokenizer.json files.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _char_class(spec: str) -> str:
    """A regex character-class body from hex code points and ranges ("0041-005A 00B5").

    Written as code points because several of these characters have look-alikes that
    editors and NFC normalization swap in (U+212A KELVIN SIGN becomes "K", turning
    "K-ℭ" into a range over most of the BMP)."""
    out = []
    for item in spec.split():
        low, _, high = item.partition("-")
        out.append(chr(int(low, 16)) + (f"-{chr(int(high, 16))}" if high else ""))
    return "".join(out)


# DeepSeek LLM / V2: the cased letters (Lu, Ll, Lt) as their tokenizer.json lists them.
_DEEPSEEK_LETTERS = _char_class(
    "0041-005A 0061-007A 00B5 00C0-00D6 00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF "
    "0370-0373 0376 0377 037B-037D 037F 0386 0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 "
    "048A-052F 0531-0556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B "
    "1D6B-1D77 1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D "
    "1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC "
    "1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128 212A-212D "
    "212F-2134 2139 213C-213F 2145-2149 214E 2183 2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2 "
    "2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 "
    "FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 "
    "118A0-118DF 1E900-1E943"
)
# ASCII and full-width punctuation, curly quotes, ideographic space and full stop.
_DEEPSEEK_PUNCT = _char_class("0021-002F 003A-007E FF01-FF0F FF1A-FF5E 2018-201F 3000-3002")
# CJK ideographs, everything from U+0800 up to them, and Hangul syllables.
_DEEPSEEK_CJK = _char_class("4E00-9FA5 0800-4E00 AC00-D7FF")
# DeepSeek-V3: CJK ideographs, Hiragana, Katakana.
_DEEPSEEK_V3_CJK = _char_class("4E00-9FA5 3040-309F 30A0-30FF")
_DEEPSEEK_V3_SPLIT = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Kimi-K2 (tiktoken, tokenization_kimi.py): gpt-4o's letter runs, but runs of Han
# ideographs stand alone: `&&` is class intersection (Oniguruma has it, as tiktoken's
# regex engine does).
_KIMI_K2_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2_SPLIT = (
    r"[\p{Han}]+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_K2_UPPER}*{_KIMI_K2_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_K2_UPPER}+{_KIMI_K2_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How one family splits text before BPE, in this order: each regex of ``splits``
    isolates its matches in every piece so far; then, with ``individual_digits``, every
    digit becomes its own piece; then the byte alphabet (with GPT-2's own regex when
    ``splits`` is empty)."""

    splits: tuple[str, ...] = ()
    individual_digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False  # whole pre-token in vocab wins (tiktoken-style vocabularies)

    def build(self) -> pre_tokenizers.PreTokenizer:
        """The ``tokenizers`` pre-tokenizer doing these steps."""
        steps: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False)
            for split in self.splits
        ]
        if self.individual_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(
            pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=False, use_regex=not self.splits
            )
        )
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


_QWEN2 = PreTokenizer(splits=(_QWEN2_SPLIT,), nfc=True)
_LLAMA3 = PreTokenizer(splits=(_LLAMA3_SPLIT,), ignore_merges=True)
_GPT4O = PreTokenizer(splits=(_GPT4O_SPLIT,))
_STARCODER = PreTokenizer(individual_digits=True)
_GPT2 = PreTokenizer()
_DEEPSEEK_LLM = PreTokenizer(
    splits=(
        r"[\r\n]",
        rf"\s?[{_DEEPSEEK_LETTERS}]+",
        rf"\s?[{_DEEPSEEK_PUNCT}]+",
        r"\s+$",
        f"[{_DEEPSEEK_CJK}]+",
    ),
    individual_digits=True,
)
_DEEPSEEK_CODER = PreTokenizer(
    splits=(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", f"[{_DEEPSEEK_CJK}]+"),
    individual_digits=True,
)
_DEEPSEEK_V3 = PreTokenizer(splits=(r"\p{N}{1,3}", f"[{_DEEPSEEK_V3_CJK}]+", _DEEPSEEK_V3_SPLIT))
# GLM-4's tokenizer is tiktoken with cl100k's pattern: Llama 3's split, whole pieces first.
_GLM4 = _LLAMA3
# Kimi-K2's tokenizer is tiktoken too: whole pieces first.
_KIMI_K2 = PreTokenizer(splits=(_KIMI_K2_SPLIT,), ignore_merges=True)

# tokenizer.ggml.pre -> how that family splits text
_PRE_TOKENIZERS: Mapping[str, PreTokenizer] = {
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "dbrx": _LLAMA3,
    "gpt-4o": _GPT4O,
    "llama4": _GPT4O,
    # DeepSeek LLM and V2 / V2.5 (one 100k vocabulary), DeepSeek Coder, DeepSeek V3 / R1.
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "deepseek-v3": _DEEPSEEK_V3,
    "glm4": _GLM4,
    "chatglm-bpe": _GLM4,
    # Kimi-K2 (arch deepseek2, its own tiktoken vocabulary).
    "kimi-k2": _KIMI_K2,
    # StarCoder-derived vocabularies (SmolLM, StarCoder, Refact) split every digit.
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
}


def pre_tokenizer(name: str) -> PreTokenizer:
    """The split a ``tokenizer.ggml.pre`` name stands for; a ValueError for an unknown one."""
    pre = _PRE_TOKENIZERS.get(name)
    if pre is None:
        # As llama.cpp does: another split gives other token ids, i.e. a wrong model.
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {name!r} is not known here (known: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}): this file needs a newer mlx-gateway, "
            "or serve the model from a folder with its tokenizer.json"
        )
    return pre
