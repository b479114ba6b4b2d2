"""The tool-call format behind each parser name: the one table that `parsers.create`
builds parsers from and the call grammars (parsers/grammars) find openers in."""

from __future__ import annotations

from parsers._call_format import CallFormat
from parsers.deepseek_v31 import DeepSeekV31Format
from parsers.glm47 import Glm47Format
from parsers.hermes import HermesFormat
from parsers.llama3_json import Llama3JsonFormat
from parsers.qwen3_coder import Qwen3CoderFormat

__all__ = ["PASSTHROUGH", "call_openers", "formats", "names"]

PASSTHROUGH = "passthrough"  # the parser with no reasoning and no tool calls


def formats() -> dict[str, type[CallFormat] | None]:
    """Tool-call format per parser name (None: reasoning only). Aliases name the
    model families that share a format."""
    return {
        "think": None,
        "hermes": HermesFormat,
        "qwen2.5": HermesFormat,
        "qwen3": HermesFormat,
        "qwen3-coder": Qwen3CoderFormat,
        "qwen3.5": Qwen3CoderFormat,
        "glm-4.5": Glm47Format,
        "glm-4.6": Glm47Format,
        "glm-4.7": Glm47Format,
        "deepseek-v3": DeepSeekV31Format,
        "deepseek-v3.1": DeepSeekV31Format,
        "llama3-json": Llama3JsonFormat,
    }


def names() -> list[str]:
    return sorted([*formats(), PASSTHROUGH])


def call_openers(name: str) -> tuple[str, ...]:
    """The markers that open a tool call in the format of parser `name`; empty for a
    parser (or a name) with no tool calls."""
    fmt = formats().get(name)
    return fmt.openers if fmt is not None else ()
