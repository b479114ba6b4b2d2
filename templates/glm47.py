"""Built-in renderer for GLM-4.7 (and GLM-4.7-Flash).

No GLM template ships with this project. Source: the official `chat_template.jinja` of
zai-org/GLM-4.7-Flash as mirrored in llama.cpp (`models/templates/GLM-4.7-Flash.jinja`),
taken to be GLM-4.7's as well. This renderer reproduces it. GLM-4.5/4.6 differ (newlines
between turns and around `<arg_key>`/`<arg_value>`, `<think></think>` on turns without
reasoning, `/nothink`), so it is not for them.

    [gMASK]<sop><|system|>\\n# Tools\\n\\n...<tools>\\n{tool json}\\n</tools>\\n\\n...
    <|system|>{system}<|user|>{user}<|assistant|><think>{reasoning}</think>{answer}
    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>
    <|observation|><tool_response>{result}</tool_response><|assistant|><think>

- turns have no separators or newlines; assistant text is trimmed;
- reasoning is kept only for assistant turns after the last user message (or for every
  turn with `clear_thinking=False` in chat_template_kwargs); other turns get a bare
  `</think>`;
- string argument values are written raw, all others as JSON;
- the generation prompt is `<|assistant|><think>`, or `<|assistant|></think>` with
  thinking off.
"""

from __future__ import annotations

from collections.abc import Sequence

from templates._common import (
    NOT_SET,
    object_arguments,
    require_messages,
    split_think,
    text_of,
    thinking_variable,
    tojson,
    tool_views,
    variable,
)
from templates.types import Message, RenderOptions, Tool, ToolCall

_TOOLS_INTRO = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\n<tools>\n"
)
_TOOLS_OUTRO = (
    "</tools>\n\nFor each function call, output the function name and arguments within "
    "the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>"
    "<arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>"
    "{arg-value-2}</arg_value>...</tool_call>"
)


def _call(call: ToolCall) -> str:
    # Arguments that are not a JSON object render as no arguments, as in the template.
    arguments = object_arguments(call.arguments) or {}
    pairs = "".join(
        f"<arg_key>{key}</arg_key><arg_value>{value if isinstance(value, str) else tojson(value)}"
        "</arg_value>"
        for key, value in arguments.items()
    )
    return f"<tool_call>{call.name}{pairs}</tool_call>"


class Glm47Renderer:
    family = "glm-4.7"

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        out = ["[gMASK]<sop>"]
        if tools:
            listing = "".join(tojson(view) + "\n" for view in tool_views(tools))
            out.append(_TOOLS_INTRO + listing + _TOOLS_OUTRO)
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        last_user = users[-1] if users else -1
        clear = variable(options, "clear_thinking")
        keep_all = clear is not NOT_SET and not clear
        for index, message in enumerate(messages):
            if message.role in ("user", "system"):
                out.append(f"<|{message.role}|>{text_of(message.content, self.family)}")
            elif message.role == "assistant":
                show = keep_all or index > last_user
                out.append(self._assistant(message, show_reasoning=show))
            elif message.role == "tool":
                out.append(self._tool(message, messages, index))
        if options.add_generation_prompt:
            thinking = thinking_variable(options)
            off = thinking is not NOT_SET and not thinking
            out.append("<|assistant|></think>" if off else "<|assistant|><think>")
        return "".join(out)

    def _assistant(self, message: Message, *, show_reasoning: bool) -> str:
        content = text_of(message.content, self.family)
        if message.reasoning is not None:
            reasoning = message.reasoning
        else:
            reasoning, content = split_think(content)
        if show_reasoning and reasoning:
            think = f"<think>{reasoning.strip()}</think>"
        else:
            think = "</think>"
        calls = "".join(_call(c) for c in message.tool_calls)
        return f"<|assistant|>{think}{content.strip()}{calls}"

    def _tool(self, message: Message, messages: Sequence[Message], index: int) -> str:
        if message.content is None:
            # The template prints only the role tag for a result without text.
            return "<|observation|>"
        opens = index == 0 or messages[index - 1].role != "tool"
        head = "<|observation|>" if opens else ""
        return f"{head}<tool_response>{text_of(message.content, self.family)}</tool_response>"
