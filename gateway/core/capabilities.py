"""What a model can do, and which renderer and parser it gets.

Decided from config.json's model_type and the chat template's own text (a template
that renders `tools` supports them; the markers it writes name the call format),
overridable from the command line (`--template-family`, `--parser`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Markers in a chat template -> the parser that reads that family's tool calls.
# Order matters: the Qwen3-Coder XML template also contains "<tool_call>".
_TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("<function=", "qwen3-coder"),
    ("<arg_key>", "glm-4.7"),
    ("tool▁calls▁begin", "deepseek-v3.1"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3-json"),
    ("ipython", "llama3-json"),
)

# Built-in renderer family -> its parser (for models served without a template).
_FAMILY_PARSERS = {
    "qwen3": "hermes",
    "qwen2.5": "hermes",
    "qwen3-coder": "qwen3-coder",
    "qwen3.5": "qwen3-coder",
    "glm-4.7": "glm-4.7",
    "deepseek-v3": "deepseek-v3.1",
    "deepseek-v3.1": "deepseek-v3.1",
    "llama3": "llama3-json",
}

_THINKING_FAMILIES = frozenset({"qwen3", "qwen3.5", "glm-4.7", "deepseek-v3.1"})


@dataclass(frozen=True)
class Capabilities:
    chat: bool  # has a chat template (or a built-in renderer)
    tools: bool
    thinking: bool
    vision: bool
    parser: str  # parsers.create name
    family: str | None  # built-in renderer family, when one is used
    # what the model serves: "generate" (chat, completions), "embed" (/v1/embeddings) or
    # "rerank" (/v1/rerank: a cross-encoder)
    task: str = "generate"

    @property
    def generates(self) -> bool:
        return self.task == "generate"

    def card(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "chat": self.chat,
            "tools": self.tools,
            "thinking": self.thinking,
            "vision": self.vision,
            "parser": self.parser,
            "template": self.family or ("model" if self.chat else None),
        }


def detect(
    *,
    model_type: str,
    chat_template: str | None,
    builtin_family: str | None,
    parser_override: str | None = None,
    vision: bool = False,
) -> Capabilities:
    """`builtin_family`: the built-in renderer in use (None when the model's own
    template renders); `vision`: the loaded model reads images (runtime.vision.spans)."""
    text = chat_template if builtin_family is None else None
    parser = "passthrough"
    tools = thinking = False
    if text is not None:
        parser = next((p for marker, p in _TEMPLATE_MARKERS if marker in text), "passthrough")
        tools = parser != "passthrough" and "tools" in text
        thinking = "<think>" in text or "enable_thinking" in text
    elif builtin_family is not None:
        parser = _FAMILY_PARSERS.get(builtin_family, "passthrough")
        tools = parser != "passthrough"
        thinking = builtin_family in _THINKING_FAMILIES
    if thinking and parser == "passthrough":
        parser = "think"
    if parser_override:
        parser = parser_override
    chat = text is not None or builtin_family is not None
    return Capabilities(chat, tools, thinking, vision and chat, parser, builtin_family)


def tool_call_opener(parser: str, name: str | None) -> str | None:
    """Text that starts the assistant turn inside the family's tool-call syntax
    (and the named function), so the model can only continue a call."""
    # with a name, the arguments object is opened too: the model can only fill it in
    if parser in ("hermes", "qwen2.5", "qwen3"):
        return '<tool_call>\n{"name": "' + (name + '", "arguments": {' if name else "")
    if parser in ("qwen3-coder", "qwen3.5"):
        return "<tool_call>\n<function=" + (name + ">\n" if name else "")
    if parser.startswith("glm-"):
        return "<tool_call>" + (name or "")
    if parser.startswith("deepseek"):
        begin = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
        return begin + (name + "<｜tool▁sep｜>{" if name else "")
    if parser == "llama3-json":
        return '{"name": "' + (name + '", "parameters": {' if name else "")
    return None
