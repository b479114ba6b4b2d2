"""Output parsers: model text -> reasoning, content and tool-call events.

Each parser is an incremental state machine registered by name and created with
`create(name, tools=None, think=None)`; `feed(text)` and `finish(truncated=False)`
return lists of events (parsers/events.py).

Composition: every parser but `passthrough` is a `<think>` splitter in front of a
tool-call format (parsers/_compose.py). `think` picks how reasoning is read:
False: none; True (the default): only if the output opens with `<think>`; "open":
the prompt ended inside an open `<think>`, so the output starts in reasoning (see
`think_mode`). A tool-call opener inside reasoning ends it. With no tools declared
(tools None or empty, as for tool_choice "none"), tool-call syntax is plain content.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from parsers._compose import ComposedParser, Format
from parsers._schema import ToolSet
from parsers._think import ThinkMode
from parsers.deepseek_v31 import DeepSeekV31Format
from parsers.events import Event
from parsers.glm47 import Glm47Format
from parsers.hermes import HermesFormat
from parsers.llama3_json import Llama3JsonFormat
from parsers.passthrough import PassthroughParser
from parsers.qwen3_coder import Qwen3CoderFormat

__all__ = ["Parser", "ThinkMode", "create", "names", "think_mode"]


class Parser(Protocol):
    def feed(self, text: str) -> list[Event]: ...
    def finish(self, *, truncated: bool = False) -> list[Event]:
        """The output is over; `truncated`: it stopped at its token limit, so tool-call
        markup left unfinished is dropped rather than shown as text."""
        ...


FormatFactory = Callable[[ToolSet], Format]


def _formats() -> dict[str, FormatFactory | None]:
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
    return sorted([*_formats(), "passthrough"])


def create(
    name: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    think: ThinkMode | None = None,
) -> Parser:
    """A fresh parser for one response. `tools` are OpenAI-shaped tool dicts."""
    if think is not None and think not in (True, False, "open"):
        raise ValueError(f"think must be True, False or 'open', not {think!r}")
    if name == "passthrough":
        return PassthroughParser()
    formats = _formats()
    if name not in formats:
        raise KeyError(f"unknown parser {name!r}; known: {', '.join(names())}")
    factory = formats[name]
    toolset = ToolSet.from_openai(tools)
    fmt = factory(toolset) if factory is not None and toolset else None
    return ComposedParser(fmt, True if think is None else think)


def think_mode(prompt: str, open_tag: str = "<think>") -> ThinkMode:
    """The `think` option for a rendered prompt: "open" when it ends inside an open
    think tag (the model's output then starts in reasoning), else True."""
    return "open" if prompt.rstrip().endswith(open_tag) else True
