"""Built-in Gemma 3 renderer, for checkpoints that ship without a chat template (GGUFs).

Produces exactly what Google's official Gemma 3 template produces through
`HFTemplateRenderer` for the same messages:

    <bos><start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n
    <start_of_turn>model\n{assistant}<end_of_turn>\n ... <start_of_turn>model\n

The system prompt is folded into the first user turn, turns must alternate
user/model, content is trimmed, images become <start_of_image>. Gemma 3 has no
tool format: tools, tool calls and reasoning are not rendered.
"""

from __future__ import annotations

from collections.abc import Sequence

from templates.types import (
    ContentPart,
    ImagePart,
    Message,
    RenderOptions,
    TemplateError,
    TextPart,
    Tool,
)

_ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."


def _turn_body(content: str | tuple[ContentPart, ...] | None) -> str:
    # Null content renders as "", as the HF path does after its null-content retry.
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if all(isinstance(part, TextPart) for part in content):
        # All-text parts reach the template joined into one string, trimmed as a whole.
        return "".join(p.text for p in content if isinstance(p, TextPart)).strip()
    return "".join(
        "<start_of_image>" if isinstance(p, ImagePart) else p.text.strip() for p in content
    )


def _system_prefix(content: str | tuple[ContentPart, ...] | None) -> str:
    """The system prompt as the official template folds it in: untrimmed, then a blank line."""
    if content is None:
        return "\n\n"
    if isinstance(content, str):
        return content + "\n\n"
    if all(isinstance(part, TextPart) for part in content):
        return "".join(p.text for p in content if isinstance(p, TextPart)) + "\n\n"
    first = content[0]
    if not isinstance(first, TextPart):
        raise TemplateError("a Gemma 3 system message with images must start with text")
    return first.text + "\n\n"


class Gemma3Renderer:
    def __init__(self, *, bos_token: str | None) -> None:
        self._bos_token = bos_token or ""

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        if not messages:
            raise TemplateError("the conversation has no messages")
        prefix = ""
        turns = list(messages)
        if turns[0].role == "system":
            prefix = _system_prefix(turns[0].content)
            turns = turns[1:]
        out = [self._bos_token]
        for index, message in enumerate(turns):
            if (message.role == "user") != (index % 2 == 0):
                raise TemplateError(_ALTERNATE)
            role = "model" if message.role == "assistant" else message.role
            lead = prefix if index == 0 else ""
            out.append(f"<start_of_turn>{role}\n{lead}{_turn_body(message.content)}<end_of_turn>\n")
        if options.add_generation_prompt:
            out.append("<start_of_turn>model\n")
        return "".join(out)
