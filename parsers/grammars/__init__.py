"""The grammar of each tool-call format, for constrained decoding: the call syntax with
each declared tool's name and its argument schema, as Lark text in llguidance's dialect
(runtime/text/constraints.py compiles it).

Formats with a grammar (by parser name, parsers.create's names): hermes, qwen2.5,
qwen3, llama3-json, deepseek-v3 and deepseek-v3.1 (json_calls.py); qwen3-coder,
qwen3.5, glm-4.5, glm-4.6 and glm-4.7 (xml_calls.py). Each grammar produces exactly what the format's parser reads back as
calls to declared tools with valid arguments, laid out as the model's template writes
calls. Markers the vocabulary holds as single tokens are written as those tokens
(`tag`), so the model writes them as it was trained to, not spelled out in pieces.

A `CallGrammar` serves the three ways a call is asked for: forced (tool_choice
required or named: `opener` ends the prompt, `after_opener` is the rest), beside a
response format (`rules` define `calls`), and auto (`lazy`: free text until a call
opener, then the call's grammar).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from parsers.grammars._common import GRAMMAR_KEY, CallGrammar, Tag
from parsers.grammars.json_calls import HERMES_CLOSE, HERMES_OPEN, deepseek, hermes, llama3_json
from parsers.grammars.lark_regex import MAX_REGEX_CHARS, GrammarTooLarge
from parsers.grammars.xml_calls import custom_lark, glm, qwen3_coder
from parsers.registry import call_openers

__all__ = [
    "GRAMMAR_KEY",
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "MAX_REGEX_CHARS",
    "CallGrammar",
    "GrammarTooLarge",
    "Tag",
    "builders",
    "call_grammar",
    "custom_lark",
    "free_calls",
    "hermes",
]

Builder = Callable[..., CallGrammar | None]  # (tools, *, tag, parallel, only) -> grammar


def builders() -> dict[str, Builder]:
    """The grammar builder of each parser name that has one."""
    return {
        "hermes": hermes,
        "qwen2.5": hermes,
        "qwen3": hermes,
        "qwen3-coder": qwen3_coder,
        "qwen3.5": qwen3_coder,
        "glm-4.5": partial(glm, newlines=True),
        "glm-4.6": partial(glm, newlines=True),
        "glm-4.7": glm,
        "deepseek-v3": partial(deepseek, v3=True),
        "deepseek-v3.1": deepseek,
        "llama3-json": llama3_json,
    }


def call_grammar(
    parser: str,
    tools: Sequence[Mapping[str, Any]],
    *,
    tag: Tag,
    parallel: bool = True,
    only: Sequence[str] | None = None,
) -> CallGrammar | None:
    """The call grammar of the format `parser` reads, over the declared `tools`
    (OpenAI-shaped), or those named in `only`; None when the format has no grammar or
    none of the tools can be called in it."""
    build = builders().get(parser)
    if build is None or not tools:
        return None
    return build(list(tools), tag=tag, parallel=parallel, only=only)


def free_calls(parser: str, *, tag: Tag) -> str | None:
    """Rules for `calls` in a format without a grammar: its call opener, then any
    tokens. Next to a response format's grammar this keeps tool calls possible (their
    syntax then unchecked) instead of ruling them out. None for a format with no
    tool calls."""
    openers = call_openers(parser)
    return f"calls: {tag(openers[0])} <[*]>*\n" if openers else None
