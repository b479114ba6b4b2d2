"""Text in and out of the model: the tokenizer, streaming detokenizing, stop strings,
sampling and constrained decoding. No file format is known here beyond a HF-style
tokenizer folder (a GGUF's tokenizer is built by runtime.load.gguf)."""

from __future__ import annotations

from runtime.text.constraints import (
    ConstraintError,
    GrammarVocabulary,
    TokenMatcher,
    check,
    json_schema_constraint,
    json_schema_rule,
    lark_constraint,
)
from runtime.text.detokenizer import DetokenizerTable, StreamingDetokenizer
from runtime.text.encoding import EncoderTokenizer, TextTokens, longest_first
from runtime.text.pair_prompt import PairPrompt
from runtime.text.sampling import (
    Sampler,
    SampleResult,
    apply_min_p,
    apply_top_k,
    apply_top_p,
)
from runtime.text.stops import StopMatcher
from runtime.text.tokenizer import Tokenizer, read_chat_template, token_ids

__all__ = [
    "ConstraintError",
    "DetokenizerTable",
    "EncoderTokenizer",
    "GrammarVocabulary",
    "PairPrompt",
    "SampleResult",
    "Sampler",
    "StopMatcher",
    "StreamingDetokenizer",
    "TextTokens",
    "TokenMatcher",
    "Tokenizer",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "check",
    "json_schema_constraint",
    "json_schema_rule",
    "lark_constraint",
    "longest_first",
    "read_chat_template",
    "token_ids",
]
