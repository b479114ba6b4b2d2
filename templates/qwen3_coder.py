"""Built-in renderer for Qwen3-Coder: ChatML with XML tool definitions and XML tool calls.

Source: the official `chat_template.jinja` of Qwen/Qwen3-Coder-30B-A3B-Instruct (and
480B-A35B), the revision with `render_extra_keys` that JSON-encodes object and array
argument values; llama.cpp mirrors it as `models/templates/Qwen3-Coder.jinja` (6211
bytes). The output equals that template's for the same messages, tools and options.

    <|im_start|>system\\n{system or "You are Qwen, a helpful AI assistant that can
    interact with a computer to solve tasks."}\\n\\n# Tools\\n\\nYou have access to the
    following functions:\\n\\n<tools>\\n<function>\\n<name>NAME</name>\\n<description>..
    </description>\\n<parameters>\\n<parameter>\\n<name>KEY</name>\\n<type>..</type>
    ...\\n</parameters>\\n</function>\\n</tools>\\n\\n{format reminder}<|im_end|>\\n

An assistant call is `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
\\n</function>\\n</tool_call>`; tool results are `<tool_response>` blocks grouped into one
user turn. Qwen3-Coder does not think: reasoning and `enable_thinking` are ignored, as
the template ignores them. The XML pieces are shared with the Qwen3.5 renderer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from templates._common import (
    jinja_string,
    object_arguments,
    require_messages,
    text_of,
    tojson,
    tool_views,
    xml_parameter_value,
)
from templates.types import Message, RenderOptions, TemplateError, Tool, ToolCall

_DEFAULT_SYSTEM = (
    "You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks."
)
# The format reminder after the tool list; Qwen3.5 uses the same words.
CALL_FORMAT_REMINDER = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    "\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the "
    "second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n"
    "</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within "
    "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may "
    "provide optional reasoning for your function call in natural language BEFORE the "
    "function call, but NOT after\n- If there is no function call available, answer the "
    "question like normal with your current knowledge and do not tell the user about "
    "function calls\n</IMPORTANT>"
)


def xml_call(call: ToolCall, family: str) -> str:
    """`<tool_call>\\n<function=NAME>\\n` + one `<parameter=KEY>\\nVALUE\\n</parameter>\\n`
    per argument + `</function>\\n</tool_call>`."""
    arguments = object_arguments(call.arguments)
    if arguments is None:
        # The template iterates the arguments as a mapping and fails on anything else.
        raise TemplateError(
            f"the {family} tool-call format needs the arguments of {call.name!r} to be a "
            f"JSON object, got {call.arguments!r}"
        )
    params = "".join(
        f"<parameter={key}>\n{xml_parameter_value(value)}\n</parameter>\n"
        for key, value in arguments.items()
    )
    return f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>"


def _extra_keys(fields: Any, handled: frozenset[str]) -> str:
    """Schema keys the template has no dedicated tag for, each as `<key>value</key>`."""
    if not isinstance(fields, Mapping):
        return ""
    out = []
    for key, value in fields.items():
        if key in handled:
            continue
        text = tojson(value) if isinstance(value, (Mapping, list)) else jinja_string(value)
        out.append(f"\n<{key}>{text}</{key}>")
    return "".join(out)


def _parameter(name: str, fields: Any) -> str:
    out = [f"\n<parameter>\n<name>{name}</name>"]
    if isinstance(fields, Mapping):
        if "type" in fields:
            out.append(f"\n<type>{jinja_string(fields['type'])}</type>")
        if "description" in fields:
            out.append(
                f"\n<description>{jinja_string(fields['description']).strip()}</description>"
            )
    out.append(_extra_keys(fields, frozenset({"name", "type", "description"})))
    out.append("\n</parameter>")
    return "".join(out)


def _function(function: Mapping[str, Any]) -> str:
    out = [f"\n<function>\n<name>{function['name']}</name>"]
    if "description" in function:
        out.append(f"\n<description>{jinja_string(function['description']).strip()}</description>")
    out.append("\n<parameters>")
    parameters = function["parameters"]
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    if isinstance(properties, Mapping):
        out.extend(_parameter(name, fields) for name, fields in properties.items())
    out.append(_extra_keys(parameters, frozenset({"type", "properties"})))
    out.append("\n</parameters>")
    out.append(_extra_keys(function, frozenset({"type", "name", "description", "parameters"})))
    out.append("\n</function>")
    return "".join(out)


def _tools_section(tools: Sequence[Tool]) -> str:
    functions = "".join(_function(view["function"]) for view in tool_views(tools))
    return (
        "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
        + functions
        + "\n</tools>"
        + CALL_FORMAT_REMINDER
    )


def _null_needs_text(turns: Sequence[Message]) -> bool:
    """Whether some null content sits where the template concatenates it, which makes
    the HF path show every null as "" (else it leaves null content out)."""
    return any(
        m.content is None and m.role != "tool" and not (m.role == "assistant" and m.tool_calls)
        for m in turns
    )


class Qwen3CoderRenderer:
    family = "qwen3-coder"

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        turns = list(messages)
        out = []
        system: str | None = None
        if turns[0].role == "system":
            # A null system message counts as none, when the HF path can leave it out.
            if turns[0].content is not None or _null_needs_text(turns[1:]):
                system = text_of(turns[0].content, self.family)
            turns = turns[1:]
        if system is not None or tools:
            out.append("<|im_start|>system\n" + (_DEFAULT_SYSTEM if system is None else system))
            if tools:
                out.append(_tools_section(tools))
            out.append("<|im_end|>\n")
        roles = [m.role for m in turns]
        for index, message in enumerate(turns):
            out.append(self._message(message, roles, index))
        if options.add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def _message(self, message: Message, roles: Sequence[str], index: int) -> str:
        text = text_of(message.content, self.family)
        if message.role == "assistant" and message.tool_calls:
            lead = "\n" + text.strip() + "\n" if text.strip() else ""
            calls = "".join("\n" + xml_call(c, self.family) for c in message.tool_calls)
            return f"<|im_start|>assistant{lead}{calls}<|im_end|>\n"
        if message.role != "tool":
            return f"<|im_start|>{message.role}\n{text}<|im_end|>\n"
        opens = index > 0 and roles[index - 1] != "tool"
        last = index == len(roles) - 1
        closes = last or roles[index + 1] != "tool"
        head = "<|im_start|>user\n" if opens else ""
        return f"{head}<tool_response>\n{text}\n</tool_response>\n" + (
            "<|im_end|>\n" if closes else ""
        )
