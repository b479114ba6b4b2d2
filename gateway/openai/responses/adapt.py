"""Responses requests -> the neutral plan: input items to template messages, tools
(function, custom, namespace; hosted ones left out), tool_choice, sampling, reasoning.

Every field is honoured, refused with a 400 naming it, or (when a client always sends
it and it means nothing on a local server) left out with a log line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from gateway.core.errors import InvalidRequest
from gateway.core.plan import (
    CachePin,
    ChatPlan,
    ToolPlan,
    render_options,
    resolve_sampling,
    sent_sampling,
)
from gateway.core.plan import tool_plan as neutral_tool_plan
from gateway.core.structured import custom_tool_grammar, format_constraint
from gateway.openai import adapt as chat_adapt
from gateway.openai import wire
from gateway.openai.responses.wire import Item, Part, ResponsesRequest
from gateway.openai.responses.wire import Tool as WireTool
from parsers.grammars import GRAMMAR_KEY
from runtime.types import Constraint, SamplingParams
from templates.types import ImagePart, Message, RenderOptions, TextPart, Tool, ToolCall

log = logging.getLogger(__name__)

# Tools OpenAI runs on its side (or that belong to its own models' trained formats):
# a local server cannot run them, and Codex always sends some, so they are left out
# of the prompt with a log line rather than refused.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26",
    "web_search_preview_2025_03_11", "file_search", "code_interpreter",
    "image_generation", "computer", "computer_use", "computer_use_preview", "mcp",
    "tool_search", "local_shell", "shell", "apply_patch",
})  # fmt: skip
# History items of those tools: skipped with a log line (this server never writes them).
HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "local_shell_call",
    "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
    "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output",
    "additional_tools", "compaction", "program", "program_output",
})  # fmt: skip
INCLUDABLE = frozenset({
    "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
})  # fmt: skip
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")
GRAMMAR_SHOWN = 4000  # longest custom-tool grammar written into the tool's description
NAMESPACE_SEP = "."  # a namespace's tool is offered to the model as "<namespace>.<name>"


@dataclass(frozen=True)
class ToolRef:
    """What a tool name in the prompt stands for, to map the model's calls back."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


ToolNames = Mapping[str, ToolRef]


def flat_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


@dataclass(frozen=True)
class Adapted:
    plan: ChatPlan
    names: ToolNames
    summary: bool  # reasoning.summary asked for a summary
    seal_reasoning: bool  # include has reasoning.encrypted_content
    items: tuple[dict[str, Any], ...]  # this request's input items, as stored


def _refuse(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", param=param, code="unsupported_parameter")


# -- tools ----------------------------------------------------------------------------


def _custom_parameters() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "The tool's free-form input."}},
        "required": ["input"],
        "additionalProperties": False,
    }


def _custom_description(tool: WireTool) -> str | None:
    fmt = tool.format or {}
    if fmt.get("type") != "grammar":
        return tool.description
    syntax = str(fmt.get("syntax") or "lark")
    definition = str(fmt.get("definition") or "")
    if len(definition) <= GRAMMAR_SHOWN:
        rule = f"The `input` string must match this {syntax} grammar:\n{definition}"
    else:
        rule = f"The `input` string must follow a {syntax} grammar (too long to show here)."
    return f"{tool.description}\n\n{rule}" if tool.description else rule


def _one_tool(tool: WireTool, where: str, namespace: str | None) -> tuple[Tool, ToolRef] | None:
    if tool.type not in ("function", "custom"):
        if tool.type in HOSTED_TOOLS:
            log.info(
                "%s: %r is a built-in OpenAI tool, not offered here; left out", where, tool.type
            )
        else:
            log.warning("%s: unknown tool type %r; left out of the prompt", where, tool.type)
        return None
    if not tool.name:
        raise InvalidRequest(f"{where} ({tool.type}) has no name", param=f"{where}.name")
    name = flat_name(tool.name, namespace)
    if tool.type == "function":
        rendered = Tool(name, tool.description, MappingProxyType(tool.parameters or {}))
        return rendered, ToolRef("function", tool.name, namespace)
    params = MappingProxyType(_custom_parameters())
    return Tool(name, _custom_description(tool), params), ToolRef("custom", tool.name, namespace)


def tools_of(tools: Sequence[WireTool] | None) -> tuple[list[Tool], dict[str, ToolRef]]:
    """The tools the model sees (namespaces flattened) and what each name stands for."""
    rendered: list[Tool] = []
    names: dict[str, ToolRef] = {}
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if tool.type == "namespace":
            if not tool.name:
                raise InvalidRequest(f"{where} (namespace) has no name", param=f"{where}.name")
            namespace: str | None = tool.name
            inner = [(t, f"{where}.tools[{j}]") for j, t in enumerate(tool.tools or ())]
        else:
            namespace, inner = None, [(tool, where)]
        for t, at in inner:
            one = _one_tool(t, at, namespace)
            if one is not None:
                rendered.append(one[0])
                names[one[0].name] = one[1]
    return rendered, names


def _find(names: ToolNames, kind: str, choice: Mapping[str, Any], param: str) -> str:
    name = choice.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(
            f'a {kind} tool_choice must look like {{"type": "{kind}", "name": ...}}', param=param
        )
    namespace = choice.get("namespace")
    flat = flat_name(name, namespace if isinstance(namespace, str) else None)
    if flat in names and names[flat].kind == kind:
        return flat
    # a namespaced tool may be named by its own name when that is unambiguous
    found = [k for k, ref in names.items() if ref.kind == kind and ref.name == name]
    if len(found) == 1:
        return found[0]
    raise InvalidRequest(f"{param} names {kind} tool {name!r}, which is not in tools", param=param)


def _allowed(names: ToolNames, choice: Mapping[str, Any]) -> tuple[str, frozenset[str]]:
    mode = choice.get("mode")
    if mode not in ("auto", "required"):
        raise InvalidRequest(
            "tool_choice allowed_tools needs mode 'auto' or 'required'", param="tool_choice.mode"
        )
    allowed: set[str] = set()
    for j, entry in enumerate(choice.get("tools") or ()):
        param = f"tool_choice.tools[{j}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind in ("function", "custom"):
            allowed.add(_find(names, kind, entry, param))
        elif kind in HOSTED_TOOLS:
            log.info("%s: hosted tool %r left out", param, kind)
        else:
            raise InvalidRequest(f"{param} is not a function or custom tool", param=param)
    return str(mode), frozenset(allowed)


def _choice(
    choice: str | dict[str, Any] | None, names: ToolNames
) -> tuple[str, str | None, frozenset[str] | None]:
    """(none|auto|required|named, the named tool, the allowed subset or None)."""
    if choice is None:
        return ("auto" if names else "none"), None, None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"tool_choice {choice!r} is not none, auto, required or a tool", param="tool_choice"
            )
        if choice == "required" and not names:
            raise InvalidRequest(
                "tool_choice 'required' needs a function or custom tool in tools", param="tools"
            )
        return (choice if names else "none"), None, None
    kind = choice.get("type")
    if kind in ("function", "custom"):
        return "named", _find(names, kind, choice, "tool_choice"), None
    if kind == "allowed_tools":
        mode, allowed = _allowed(names, choice)
        if not allowed:
            if mode == "required":
                raise InvalidRequest(
                    "tool_choice allowed_tools 'required' allows no function or custom tool",
                    param="tool_choice",
                )
            return "none", None, None
        if mode == "required" and len(allowed) == 1:
            return "named", next(iter(allowed)), allowed
        return mode, None, allowed
    raise _refuse(
        "tool_choice",
        f"{kind!r} forces a hosted tool, which this server cannot run; use a function or "
        "custom tool, 'auto', 'required' or 'none'",
    )


def tool_plan(req: ResponsesRequest, *, supported: bool) -> tuple[ToolPlan, dict[str, ToolRef]]:
    rendered, names = tools_of(req.tools)
    choice, name, allowed = _choice(req.tool_choice, names)
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    plan = neutral_tool_plan(rendered, choice, name, parallel, supported=supported)
    if allowed is not None and plan.schemas:
        # every tool stays in the prompt (so the cached prefix holds), but only the
        # allowed ones are read back as calls
        kept = tuple(s for s in plan.schemas if s["function"]["name"] in allowed)
        plan = dataclasses.replace(plan, schemas=kept)
    grammars = _input_grammars(req.tools)
    if grammars and plan.schemas:
        schemas = tuple(_with_grammar(s, grammars.get(s["function"]["name"])) for s in plan.schemas)
        plan = dataclasses.replace(plan, schemas=schemas)
    return plan, names


def _input_grammars(tools: Sequence[WireTool] | None) -> dict[str, dict[str, str]]:
    """The grammar of each custom tool whose format is one, by the name the model sees
    (a 400 for a grammar the engine cannot compile)."""
    found: dict[str, dict[str, str]] = {}
    for i, tool in enumerate(tools or ()):
        if tool.type == "namespace":
            inner = [
                (t, f"tools[{i}].tools[{j}]", tool.name) for j, t in enumerate(tool.tools or ())
            ]
        else:
            inner = [(tool, f"tools[{i}]", None)]
        for t, where, namespace in inner:
            if t.type != "custom" or not t.name:
                continue
            grammar = custom_tool_grammar(t.format, param=f"{where}.format")
            if grammar is not None:
                found[flat_name(t.name, namespace)] = grammar
    return found


def _with_grammar(schema: dict[str, Any], grammar: dict[str, str] | None) -> dict[str, Any]:
    """A custom tool's schema for the output side (the call grammar and the parser):
    its `input` carries the tool's grammar. The prompt shows the tool without it."""
    if grammar is None:
        return schema
    params = dict(schema["function"]["parameters"])
    props = dict(params.get("properties") or {})
    props["input"] = {**props.get("input", {"type": "string"}), GRAMMAR_KEY: grammar}
    params["properties"] = props
    return {**schema, "function": {**schema["function"], "parameters": params}}


# -- input items -> messages ----------------------------------------------------------


def _part(part: Part, where: str) -> TextPart | ImagePart:
    if part.type == "input_file" or (part.type == "input_image" and part.file_id):
        raise InvalidRequest(
            f"{where} refers to a file (file_id/input_file); this server has no Files API: "
            "send text, or images as image_url (a URL or a data: URI)",
            param=f"{where}.file_id" if part.file_id else f"{where}.type",
        )
    url = part.image_url
    if isinstance(url, dict):
        url = url.get("url") if isinstance(url.get("url"), str) else None
    as_chat = wire.ContentPart(type=part.type, text=part.text, refusal=part.refusal, image_url=url)
    return chat_adapt.content_part(as_chat, where)


def _content(
    content: str | list[Part] | None, where: str
) -> str | tuple[TextPart | ImagePart, ...]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [_part(p, f"{where}[{j}]") for j, p in enumerate(content)]
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return tuple(parts)


def _text(content: str | list[Part] | None) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text or p.refusal or "" for p in content or ())


@dataclass
class _Assistant:
    content: list[str] = dataclasses.field(default_factory=list)
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    reasoning: list[str] = dataclasses.field(default_factory=list)

    def message(self) -> Message | None:
        if not self.content and not self.calls:
            return None  # reasoning alone, with nothing after it, is not a turn
        reasoning = "\n\n".join(self.reasoning) or None
        return Message("assistant", "".join(self.content), tool_calls=tuple(self.calls),
                       reasoning=reasoning)  # fmt: skip


class _Conversation:
    """Items in order -> messages. Consecutive assistant items (reasoning, text, calls)
    are one assistant turn: the model wrote them in one reply, and a chat template
    expects a tool result to follow the turn that holds its call."""

    def __init__(self, open_sealed: Callable[[str], str | None]) -> None:
        self.messages: list[Message] = []
        self._turn: _Assistant | None = None
        self._open_sealed = open_sealed

    def _close(self) -> None:
        if self._turn is not None:
            msg = self._turn.message()
            if msg is not None:
                self.messages.append(msg)
            self._turn = None

    @property
    def _assistant(self) -> _Assistant:
        if self._turn is None:
            self._turn = _Assistant()
        return self._turn

    def other(self, msg: Message) -> None:
        self._close()
        self.messages.append(msg)

    def reasoning(self, item: Item) -> None:
        text = _text(item.content)
        if not text and item.encrypted_content:
            text = self._open_sealed(item.encrypted_content) or ""
        if not text:
            text = "\n\n".join(p.text or "" for p in item.summary or ())
        if text:
            self._assistant.reasoning.append(text)

    def text(self, text: str) -> None:
        self._assistant.content.append(text)

    def call(self, call: ToolCall) -> None:
        self._assistant.calls.append(call)

    def done(self) -> tuple[Message, ...]:
        self._close()
        return tuple(self.messages)


def _arguments(item: Item, where: str) -> str:
    args = item.arguments or "{}"
    try:
        json.loads(args)
    except json.JSONDecodeError:
        raise InvalidRequest(
            f"{where}.arguments is not valid JSON", param=f"{where}.arguments"
        ) from None
    return args


def _need(value: str | None, where: str, kind: str, name: str) -> str:
    if not value:
        raise InvalidRequest(f"{where} ({kind}) has no {name}", param=f"{where}.{name}")
    return value


def _message(item: Item, where: str, conv: _Conversation) -> None:
    role = item.role
    if role == "assistant":
        conv.text(_text(item.content))
        return
    if role not in ("user", "system", "developer"):
        raise InvalidRequest(
            f"{where} has role {role!r}; use user, assistant, system or developer",
            param=f"{where}.role",
        )
    content = _content(item.content, f"{where}.content")
    conv.other(Message("system" if role == "developer" else role, content))


def _tool_output(item: Item, where: str, conv: _Conversation) -> None:
    call_id = _need(item.call_id, where, str(item.type), "call_id")
    output = item.output
    if isinstance(output, dict):
        output = json.dumps(output, ensure_ascii=False)
    content = _content(output, f"{where}.output")
    conv.other(Message("tool", content, tool_call_id=call_id))


def _item(item: Item, where: str, conv: _Conversation) -> None:
    kind = item.type or "message"
    if kind == "message":
        _message(item, where, conv)
    elif kind == "function_call":
        name = flat_name(_need(item.name, where, kind, "name"), item.namespace)
        call_id = _need(item.call_id, where, kind, "call_id")
        conv.call(ToolCall(call_id, name, _arguments(item, where)))
    elif kind == "custom_tool_call":
        name = flat_name(_need(item.name, where, kind, "name"), item.namespace)
        call_id = _need(item.call_id, where, kind, "call_id")
        args = json.dumps({"input": item.input or ""}, ensure_ascii=False)
        conv.call(ToolCall(call_id, name, args))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        _tool_output(item, where, conv)
    elif kind == "reasoning":
        conv.reasoning(item)
    elif kind in HOSTED_ITEMS:
        log.info("%s: %r item left out (this server runs no hosted tools)", where, kind)
    else:
        raise InvalidRequest(
            f"{where} has type {kind!r}, which this server cannot read", param=f"{where}.type"
        )


ItemLookup = Callable[[str], dict[str, Any] | None]


def _resolve(item: Item, where: str, lookup: ItemLookup) -> Item:
    if item.type != "item_reference":
        return item
    ref = _need(item.id, where, "item_reference", "id")
    found = lookup(ref)
    if found is None:
        raise InvalidRequest(
            f"{where} refers to item {ref!r}, which this server has not stored",
            param=f"{where}.id",
        )
    return Item.model_validate(found)


def input_items(req: ResponsesRequest, lookup: ItemLookup) -> list[Item]:
    """The request's items, item references resolved."""
    if isinstance(req.input, str):
        return [Item(type="message", role="user", content=req.input)]
    return [_resolve(item, f"input[{i}]", lookup) for i, item in enumerate(req.input)]


def to_messages(
    history: Sequence[dict[str, Any]],
    items: Sequence[Item],
    *,
    instructions: str | None,
    open_sealed: Callable[[str], str | None],
) -> tuple[Message, ...]:
    conv = _Conversation(open_sealed)
    if instructions:
        conv.other(Message("system", instructions))
    for j, stored in enumerate(history):
        _item(Item.model_validate(stored), f"previous_response_id item {j}", conv)
    for i, item in enumerate(items):
        _item(item, f"input[{i}]", conv)
    return conv.done()


# -- the rest of the request ------------------------------------------------------------


def _check_text(req: ResponsesRequest) -> None:
    verbosity = req.text.verbosity if req.text else None
    if verbosity not in (None, "medium"):
        # Codex sends "low": refusing would break it, and a local model has no trained
        # verbosity switch; the prompt is left as sent rather than edited
        log.info("text.verbosity %r is not applied: this model has no verbosity control", verbosity)


def _check_include(req: ResponsesRequest) -> None:
    for value in req.include or ():
        if value == "message.output_text.logprobs":
            raise _refuse(
                "include", "message.output_text.logprobs is not served on /v1/responses yet; "
                "use /v1/chat/completions with logprobs"
            )  # fmt: skip
        if value not in INCLUDABLE:
            log.info("include %r: nothing of that kind is produced here", value)


def text_format(req: ResponsesRequest) -> Constraint | None:
    """text.format: "text", "json_object", or "json_schema" with the schema inline
    ({"type": "json_schema", "name": ..., "schema": {...}, "strict": ...})."""
    fmt = req.text.format if req.text else None
    if fmt is None:
        return None
    return format_constraint(
        fmt.type,
        (fmt.model_extra or {}).get("schema"),
        param="text.format",
        schema_param="text.format.schema",
        kinds=("text", "json_object", "json_schema"),
    )


def refuse_unsupported(req: ResponsesRequest) -> None:
    """Known fields this server cannot honour: a 400 naming each."""
    if req.background:
        raise _refuse("background", "background responses are not supported; send it false")
    if req.conversation is not None:
        raise _refuse(
            "conversation",
            "this server has no Conversations API; use previous_response_id or send the input",
        )
    if req.prompt is not None:
        raise _refuse("prompt", "stored prompt templates are not supported; send input")
    if req.top_logprobs:
        raise _refuse("top_logprobs", "logprobs are not served on /v1/responses yet")
    _check_text(req)
    _check_include(req)
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning.effort"
        )


def wants_summary(req: ResponsesRequest) -> bool:
    r = req.reasoning
    return r is not None and (r.summary or r.generate_summary) in SUMMARIES


def _options(req: ResponsesRequest) -> RenderOptions:
    effort = req.reasoning.effort if req.reasoning else None
    # "none" and "minimal" switch thinking off where the template has a switch; any
    # other effort asks for it; no effort leaves the template's default
    thinking = None if effort is None else effort not in ("none", "minimal")
    return render_options(None, effort, enable_thinking=thinking)


def _sampling(req: ResponsesRequest, defaults: Mapping[str, float] | None) -> SamplingParams:
    sent = sent_sampling(req)
    return resolve_sampling(sent, defaults)


def response_plan(
    req: ResponsesRequest,
    *,
    history: Sequence[dict[str, Any]],
    lookup: ItemLookup,
    open_sealed: Callable[[str], str | None],
    tools_supported: bool,
    defaults: Mapping[str, float] | None = None,
) -> Adapted:
    refuse_unsupported(req)
    items = input_items(req, lookup)
    messages = to_messages(history, items, instructions=req.instructions, open_sealed=open_sealed)
    if not messages:
        raise InvalidRequest("input is empty; send a string or at least one item", param="input")
    tools, names = tool_plan(req, supported=tools_supported)
    plan = ChatPlan(
        messages=messages,
        tools=tools,
        options=_options(req),
        sampling=_sampling(req, defaults),
        max_tokens=req.max_output_tokens,
        stop=(),
        stream=req.stream,
        max_tokens_field="max_output_tokens",
        messages_field="input",
        pin=CachePin(key=req.prompt_cache_key) if req.prompt_cache_key else None,
        constraint=text_format(req),
    )
    stored = tuple(i.model_dump(exclude_none=True, by_alias=True) for i in items)
    include = req.include or ()
    return Adapted(
        plan, names, wants_summary(req), "reasoning.encrypted_content" in include, stored
    )
