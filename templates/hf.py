"""Rendering with a model's own Hugging Face chat template.

Messages reach the template as plain dicts in the OpenAI-like shape that HF
templates are written (and tested with transformers) against.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jinja2

from templates.jinja_env import RaisedByTemplate, make_environment
from templates.render_limits import RenderLimits, render_budget
from templates.types import (
    ImagePart,
    Message,
    RenderOptions,
    TemplateError,
    TextPart,
    Tool,
    ToolCall,
)

# Errors a template can raise while rendering; anything else is our bug, not bad input.
_RENDER_ERRORS = (
    jinja2.TemplateError,
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    ArithmeticError,
    RecursionError,
    MemoryError,
)


class JsonArguments(dict[str, Any]):
    """Tool-call arguments: a dict for templates that iterate or `tojson` them, that
    still reads as the original JSON text where a template concatenates or prints it
    (DeepSeek's templates do `'...' + arguments`)."""

    def __init__(self, parsed: Mapping[str, Any], text: str) -> None:
        super().__init__(parsed)
        self._text = text

    def __str__(self) -> str:
        return self._text

    def __add__(self, other: object) -> Any:
        if isinstance(other, str):
            return self._text + other
        return NotImplemented

    def __radd__(self, other: object) -> Any:
        if isinstance(other, str):
            return other + self._text
        return NotImplemented


def plain(value: Any) -> Any:
    """Deep copy into JSON-like builtins (mappings -> dict, sequences -> list)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def tool_arguments(text: str) -> Any:
    """Arguments as a dict when the JSON text is an object; otherwise the text itself."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return JsonArguments(parsed, text) if isinstance(parsed, dict) else text


def _content(content: str | tuple[TextPart | ImagePart, ...] | None) -> Any:
    if content is None or isinstance(content, str):
        return content
    if all(isinstance(part, TextPart) for part in content):
        return "".join(part.text for part in content if isinstance(part, TextPart))
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
        else:
            parts.append({"type": "image", "image": part.source})
    return parts


def _tool_call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": tool_arguments(call.arguments)}
    return {"id": call.id, "type": "function", "function": function}


def message_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The template's view of the conversation. Keys are present only when set, since
    templates test `is defined` as often as truthiness."""
    names_by_call_id = {c.id: c.name for m in messages for c in m.tool_calls}
    out: list[dict[str, Any]] = []
    for message in messages:
        d: dict[str, Any] = {"role": message.role, "content": _content(message.content)}
        name = message.name
        if name is None and message.tool_call_id is not None:
            # Tool results often arrive without the function name; some templates print it.
            name = names_by_call_id.get(message.tool_call_id)
        if name is not None:
            d["name"] = name
        if message.tool_calls:
            d["tool_calls"] = [_tool_call(c) for c in message.tool_calls]
        if message.tool_call_id is not None:
            d["tool_call_id"] = message.tool_call_id
        if message.reasoning is not None:
            # Same aliases as transformers: gpt-oss templates read `thinking`.
            d = {"thinking": message.reasoning, **d, "reasoning_content": message.reasoning}
        out.append(d)
    return out


def tool_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    """OpenAI function-tool shape; None when there are none (templates test `tools is not none`)."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = plain(tool.parameters)
        out.append({"type": "function", "function": function})
    return out


def template_variables(
    options: RenderOptions, *, bos_token: str | None, eos_token: str | None
) -> dict[str, Any]:
    """Everything but messages and tools. Options left at None are not defined at all,
    so templates apply their own defaults (`enable_thinking is defined`)."""
    # A missing special token is undefined (renders ""), as in transformers, not None ("None").
    variables: dict[str, Any] = {}
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables.update(plain(options.extra))
    for reserved in ("messages", "tools", "documents", "add_generation_prompt"):
        if reserved in variables:
            raise TemplateError(f"chat_template_kwargs may not set {reserved!r}")
    if options.enable_thinking is not None:
        variables["enable_thinking"] = options.enable_thinking
    if options.reasoning_effort is not None:
        variables["reasoning_effort"] = options.reasoning_effort
    variables["add_generation_prompt"] = options.add_generation_prompt
    return variables


def compile_template(source: str, limits: RenderLimits | None = None) -> jinja2.Template:
    try:
        return make_environment(limits).from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the model's chat template does not compile: {exc}") from exc


class HFTemplateRenderer:
    """A model's jinja chat template, compiled once; each render bounded by `limits`."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None,
        eos_token: str | None,
        limits: RenderLimits | None = None,
    ) -> None:
        self.source = source
        self._limits = limits or RenderLimits()
        self._template = compile_template(source, self._limits)
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        if not messages:
            raise TemplateError("the conversation has no messages")
        variables = template_variables(
            options, bos_token=self._bos_token, eos_token=self._eos_token
        )
        variables["tools"] = tool_dicts(tools)
        variables["documents"] = None
        first_error: TemplateError | None = None
        with render_budget(self._limits):  # one deadline for every variant tried
            for candidate in _null_content_variants(message_dicts(messages)):
                try:
                    return self._run(candidate, variables)
                except TemplateError as exc:
                    first_error = first_error or exc
        assert first_error is not None  # the variants are never empty
        raise first_error

    def _run(self, messages: list[dict[str, Any]], variables: dict[str, Any]) -> str:
        try:
            return self._template.render(messages=messages, **variables)
        except RaisedByTemplate as exc:
            raise TemplateError(str(exc)) from exc
        except _RENDER_ERRORS as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def _null_content_variants(dicts: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Ways to show a template a message with null content (clients send `content: null`
    beside tool calls), tried in order until one renders: the key left out, as
    transformers does; None, which DeepSeek's templates test for; "", for templates
    that concatenate content unconditionally (Qwen3)."""
    if all(d["content"] is not None for d in dicts):
        yield dicts
        return
    yield [{k: v for k, v in d.items() if not (k == "content" and v is None)} for d in dicts]
    yield dicts
    yield [{**d, "content": "" if d["content"] is None else d["content"]} for d in dicts]
