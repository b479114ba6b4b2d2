"""Built-in renderer for Qwen3.5: Qwen3-Coder's XML tool calls with Qwen3's thinking.

Source: the official `chat_template.jinja` of the Qwen3.5 checkpoints, as shipped in
mlx-community/Qwen3.5-35B-A3B-4bit (sha256 a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715).
The output equals that template's for the same messages, tools and options.

Differences from Qwen3 and Qwen3-Coder, all from that template:

- tools are listed as JSON lines (`tool | tojson`) under "# Tools\\n\\nYou have access to
  the following functions:\\n\\n<tools>", followed by Qwen3-Coder's format reminder; the
  system message comes after the tool list, trimmed;
- calls are Qwen3-Coder's XML (`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n...`);
- every message's text is trimmed; images become `<|vision_start|><|image_pad|><|vision_end|>`;
- every assistant turn after the last real user query shows a `<think>` block, empty or
  not, and the generation prompt opens `<think>\\n` (or an empty block when thinking is off);
- the template refuses: no user query, a system message after the first, unknown roles,
  images in the system message.
"""

from __future__ import annotations

from collections.abc import Sequence

from templates._common import (
    require_messages,
    split_think,
    thinking_variable,
    tojson,
    tool_views,
)
from templates.qwen3 import find_last_query, tool_result
from templates.qwen3_coder import CALL_FORMAT_REMINDER, xml_call
from templates.types import ContentPart, ImagePart, Message, RenderOptions, TemplateError, Tool

_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _text(content: str | tuple[ContentPart, ...] | None, *, system: bool = False) -> str:
    """`render_content(content)|trim`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if system and any(isinstance(part, ImagePart) for part in content):
        raise TemplateError("System message cannot contain images.")
    return "".join(_IMAGE if isinstance(p, ImagePart) else p.text for p in content).strip()


def _system(messages: Sequence[Message], tools: Sequence[Tool]) -> str:
    first = messages[0]
    system = _text(first.content, system=True) if first.role == "system" else None
    if not tools:
        return "" if system is None else f"<|im_start|>system\n{system}<|im_end|>\n"
    listing = "".join("\n" + tojson(view) for view in tool_views(tools))
    tail = "\n\n" + system if system else ""
    return (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
        + listing
        + "\n</tools>"
        + CALL_FORMAT_REMINDER
        + tail
        + "<|im_end|>\n"
    )


class Qwen35Renderer:
    family = "qwen3.5"

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        out = [_system(messages, tools)]
        texts = [(m.role, _text(m.content)) for m in messages]
        last_query = find_last_query(texts)
        if last_query is None:
            raise TemplateError("No user query found in messages.")
        roles = [role for role, _ in texts]
        for index, message in enumerate(messages):
            text = texts[index][1]
            if message.role == "system":
                if index > 0:
                    raise TemplateError("System message must be at the beginning.")
            elif message.role == "user":
                out.append(f"<|im_start|>user\n{text}<|im_end|>\n")
            elif message.role == "assistant":
                out.append(self._assistant(message, text, after_query=index > last_query))
            elif message.role == "tool":
                opens = index > 0 and roles[index - 1] != "tool"
                out.append(tool_result(roles, index, text, opens=opens))
            else:
                raise TemplateError("Unexpected message role.")
        if options.add_generation_prompt:
            thinking_off = thinking_variable(options) is False
            out.append("<|im_start|>assistant\n")
            out.append("<think>\n\n</think>\n\n" if thinking_off else "<think>\n")
        return "".join(out)

    def _assistant(self, message: Message, text: str, *, after_query: bool) -> str:
        content = text
        if message.reasoning is not None:
            reasoning = message.reasoning
        else:
            reasoning, content = split_think(text)
        reasoning = reasoning.strip()
        if after_query:
            out = [f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}"]
        else:
            out = [f"<|im_start|>assistant\n{content}"]
        for number, call in enumerate(message.tool_calls):
            if number > 0:
                out.append("\n")
            elif content.strip():
                out.append("\n\n")
            out.append(xml_call(call, self.family))
        out.append("<|im_end|>\n")
        return "".join(out)
