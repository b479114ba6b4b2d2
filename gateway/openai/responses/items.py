"""Responses input items -> template messages: messages, function and custom tool calls
and their outputs, reasoning, and stored items looked up by id; hosted tools' history
items are left out with a log line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.openai import adapt as chat_adapt
from gateway.openai import wire
from gateway.openai.responses.tools import flat_name
from gateway.openai.responses.wire import Item, Part, ResponsesRequest
from templates.types import ImagePart, Message, TextPart, ToolCall

log = logging.getLogger(__name__)

# History items of those tools: skipped with a log line (this server never writes them).
HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "local_shell_call",
    "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
    "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output",
    "additional_tools", "compaction", "program", "program_output",
})  # fmt: skip

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
