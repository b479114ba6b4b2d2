"""Anthropic Messages requests -> the neutral ChatPlan.

Every field is honoured, refused with a 400 naming it, or (for fields that mean
nothing on a local server: metadata, service_tier, speed, container, ...) accepted
and ignored. Anthropic's own tools (web search, bash, text editor: the model was
trained on their schemas, which the request does not carry) are left out with one
log line, since clients send them whatever the server (tools.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from gateway.anthropic import wire
from gateway.anthropic.emit import thinking_from_signature
from gateway.anthropic.tools import tools_of
from gateway.core.errors import InvalidRequest
from gateway.core.limits import MAX_MESSAGES, check_count
from gateway.core.plan import (
    CachePin,
    ChatPlan,
    SamplingFields,
    render_options,
    resolve_sampling,
    stops,
)
from gateway.core.structured import format_constraint
from runtime.types import Constraint
from templates.types import ContentPart, ImagePart, Message, TextPart, ToolCall

log = logging.getLogger(__name__)

# Claude Code's per-request attribution line: it changes every request (cch=...), so
# left in the system prompt it would end the shared prefix at the first token
BILLING_PREFIX = "x-anthropic-billing-header:"

EFFORTS = ("low", "medium", "high", "xhigh", "max")
# templates know low/medium/high; Anthropic's two higher levels ask for the most
_EFFORT_NAMES = MappingProxyType({"xhigh": "high", "max": "high"})

CACHE_TTLS = MappingProxyType({None: 300.0, "5m": 300.0, "1h": 3600.0})

Content = str | tuple[ContentPart, ...]


def _refuse(where: str, kind: str, hint: str) -> InvalidRequest:
    return InvalidRequest(
        f"{where} has type {kind!r}, which this server cannot read; {hint}",
        param=f"{where}.type",
    )


def join_texts(texts: Sequence[str]) -> str:
    """Consecutive text blocks as one text: a newline between two blocks unless the
    first already ends with one (clients split paragraphs into blocks)."""
    out = ""
    for text in texts:
        if out and text and not out.endswith("\n"):
            out += "\n"
        out += text
    return out


def _joined(parts: Sequence[ContentPart]) -> Content:
    if all(isinstance(p, TextPart) for p in parts):
        return join_texts([p.text for p in parts if isinstance(p, TextPart)])
    return tuple(parts)


# -- blocks ------------------------------------------------------------------------------


def _image(block: wire.Block, where: str) -> ImagePart:
    src = block.source
    if not isinstance(src, wire.Source):
        raise InvalidRequest(f"{where} is an image with no source object", param=f"{where}.source")
    if src.type == "base64":
        if not src.data or not src.media_type:
            raise InvalidRequest(
                f"{where}.source (base64) needs media_type and data", param=f"{where}.source"
            )
        return ImagePart(f"data:{src.media_type};base64,{src.data}")
    if src.type == "url" and src.url:
        return ImagePart(src.url)
    raise InvalidRequest(
        f"{where}.source has type {src.type!r}; this server reads base64 and url image "
        "sources (there is no Files API here)",
        param=f"{where}.source.type",
    )


def _part(block: wire.Block, where: str) -> ContentPart:
    if block.type == "text":
        return TextPart(block.text or "")
    if block.type == "image":
        return _image(block, where)
    raise _refuse(where, block.type, "send text and image blocks (and tool_result blocks)")


def _text_only(blocks: Sequence[wire.Block], where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise _refuse(f"{where}[{j}]", block.type, "system content must be text blocks")
        texts.append(block.text or "")
    return join_texts(texts)


def _tool_result(block: wire.Block, where: str) -> Message:
    if not block.tool_use_id:
        raise InvalidRequest(
            f"{where} is a tool_result with no tool_use_id", param=f"{where}.tool_use_id"
        )
    raw = block.content
    content: Content
    if raw is None or isinstance(raw, str):
        content = raw or ""
    elif isinstance(raw, dict):
        raise InvalidRequest(
            f"{where}.content must be a string or a list of blocks", param=f"{where}.content"
        )
    else:
        content = _joined([_part(b, f"{where}.content[{k}]") for k, b in enumerate(raw)])
    if block.is_error:
        # templates have no error flag: the model reads it in the text
        content = (
            "Error: " + content if isinstance(content, str) else (TextPart("Error:"), *content)
        )
    return Message(role="tool", content=content, tool_call_id=block.tool_use_id)


# -- messages ----------------------------------------------------------------------------


def _user(msg: wire.InputMessage, i: int) -> list[Message]:
    """A user turn: tool results become tool messages (in order); the text and images
    around them become user messages."""
    if isinstance(msg.content, str):
        return [Message(role="user", content=msg.content)]
    out: list[Message] = []
    parts: list[ContentPart] = []
    for j, block in enumerate(msg.content):
        where = f"messages[{i}].content[{j}]"
        if block.type == "tool_result":
            if parts:
                out.append(Message(role="user", content=_joined(parts)))
                parts = []
            out.append(_tool_result(block, where))
        else:
            parts.append(_part(block, where))
    if parts or not out:
        out.append(Message(role="user", content=_joined(parts)))
    return out


def _tool_use(block: wire.Block, where: str) -> ToolCall:
    if not block.id or not block.name:
        raise InvalidRequest(f"{where} is a tool_use without an id or a name", param=where)
    if not isinstance(block.input, dict):
        raise InvalidRequest(f"{where}.input must be an object", param=f"{where}.input")
    return ToolCall(block.id, block.name, json.dumps(block.input, ensure_ascii=False))


def _thinking(block: wire.Block) -> str:
    """A thinking block's text; one whose text was omitted is recovered from our own
    signature, which carries it."""
    if block.thinking:
        return block.thinking
    recovered = thinking_from_signature(block.signature or "")
    return recovered or ""


def _assistant(msg: wire.InputMessage, i: int, keep_reasoning: bool) -> Message:
    if isinstance(msg.content, str):
        return Message(role="assistant", content=msg.content)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(msg.content):
        where = f"messages[{i}].content[{j}]"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            reasoning.append(_thinking(block))
        elif block.type == "redacted_thinking":
            continue  # encrypted by another server: nothing a local model can read
        elif block.type == "tool_use":
            calls.append(_tool_use(block, where))
        else:
            raise _refuse(where, block.type, "assistant turns hold text, thinking and tool_use")
    thought = join_texts([r for r in reasoning if r])
    return Message(
        role="assistant",
        content=join_texts(texts) if texts or not calls else None,
        tool_calls=tuple(calls),
        reasoning=thought if keep_reasoning and thought else None,
    )


def _system_turn(msg: wire.InputMessage, i: int) -> Message:
    text = msg.content
    if not isinstance(text, str):
        text = _text_only(text, f"messages[{i}].content")
    return Message(role="system", content=text)


def _strip_billing(text: str) -> str:
    """The text without a leading billing-header line."""
    if not text.lstrip().startswith(BILLING_PREFIX):
        return text
    _, _, rest = text.lstrip().partition("\n")
    return rest.lstrip("\n")


def system_text(system: str | list[wire.Block] | None) -> str | None:
    """The top-level system prompt as one text, without Claude Code's billing header."""
    if system is None:
        return None
    if isinstance(system, str):
        texts = [system]
    else:
        _text_only(system, "system")  # refuses non-text blocks
        texts = [b.text or "" for b in system]
    kept = []
    for text in texts:
        stripped = _strip_billing(text)
        if stripped != text:
            log.debug("removed the x-anthropic-billing-header line from the system prompt")
        if stripped:
            kept.append(stripped)
    return join_texts(kept) if kept else None


def thinking_turns_kept(req: wire.PromptRequest) -> int | None:
    """How many of the latest assistant turns keep their thinking (None: all).

    A clear_thinking edit keeps `keep.value` turns ({"type": "thinking_turns"}), all
    of them ("all" or {"type": "all"}), or, with no `keep`, the last one."""
    edits = req.context_management.edits if req.context_management else []
    kept: int | None = None
    for k, edit in enumerate(edits):
        where = f"context_management.edits[{k}]"
        if not edit.type.startswith("clear_thinking_"):
            raise InvalidRequest(
                f"{where} has type {edit.type!r}, which this server does not apply; "
                "only clear_thinking edits are supported",
                param=f"{where}.type",
            )
        keep = edit.keep
        if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all"):
            continue
        if keep is None:
            turns = 1
        elif isinstance(keep, dict) and keep.get("type") == "thinking_turns":
            value = keep.get("value")
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidRequest(
                    f"{where}.keep.value must be a non-negative integer",
                    param=f"{where}.keep.value",
                )
            turns = value
        else:
            raise InvalidRequest(
                f'{where}.keep must be "all" or {{"type": "thinking_turns", "value": N}}',
                param=f"{where}.keep",
            )
        kept = turns if kept is None else min(kept, turns)
    return kept


def to_messages(req: wire.PromptRequest) -> tuple[Message, ...]:
    keep = thinking_turns_kept(req)
    assistants = sum(1 for m in req.messages if m.role == "assistant")
    out: list[Message] = []
    system = system_text(req.system)
    if system is not None:
        out.append(Message(role="system", content=system))
    seen = 0  # assistant turns so far
    for i, msg in enumerate(req.messages):
        if msg.role == "user":
            out.extend(_user(msg, i))
        elif msg.role == "system":
            out.append(_system_turn(msg, i))
        else:
            seen += 1
            out.append(_assistant(msg, i, keep is None or assistants - seen < keep))
    last = next((m for m in reversed(out) if m.role != "system"), None)
    if last is not None and last.role == "assistant":
        raise InvalidRequest(
            "The conversation ends with an assistant turn (prefill), which this server "
            "does not continue; end it with a user turn.",
            param=f"messages[{len(req.messages) - 1}]",
        )
    return tuple(out)


def fold_system(messages: Sequence[Message]) -> tuple[Message, ...] | None:
    """The conversation with system turns after the first non-system one moved into
    user turns, for templates that accept a system message only at the start (None:
    there is none to move). Each joins the user turn before it, else stands as one,
    so earlier turns render as before and the prefix cache still matches."""
    if not any(m.role == "system" for m in messages[1:]):
        return None
    out: list[Message] = []
    for m in messages:
        if m.role != "system":
            out.append(m)
            continue
        text = m.content if isinstance(m.content, str) else _joined(m.content or ())
        assert isinstance(text, str)
        if all(p.role == "system" for p in out):
            if out:  # leading system turns become one
                out[0] = replace(out[0], content=join_texts([str(out[0].content), text]))
            else:
                out.append(m)
            continue
        note = f"<system-reminder>\n{text}\n</system-reminder>"
        prev = out[-1]
        if prev.role == "user" and isinstance(prev.content, str):
            out[-1] = replace(prev, content=join_texts([prev.content, note]))
        elif prev.role == "user" and isinstance(prev.content, tuple):
            out[-1] = replace(prev, content=(*prev.content, TextPart(note)))
        else:
            out.append(Message(role="user", content=note))
    return tuple(out)


# -- thinking, sampling ----------------------------------------------------------------


def _effort(req: wire.PromptRequest) -> str | None:
    effort = req.output_config.effort if req.output_config else None
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise InvalidRequest(
            f"output_config.effort must be one of {', '.join(EFFORTS)}",
            param="output_config.effort",
        )
    return _EFFORT_NAMES.get(effort, effort)


def render_switches(req: wire.PromptRequest) -> tuple[bool | None, str | None]:
    """(enable_thinking, reasoning_effort): thinking enabled or adaptive turns the
    template's thinking on, disabled turns it off (and then effort is not passed, so it
    cannot turn thinking back on); absent leaves the template's default."""
    thinking = req.thinking
    enable = None if thinking is None else thinking.type != "disabled"
    effort = _effort(req)
    return enable, (None if enable is False else effort)


def cache_pin(req: wire.PromptRequest) -> CachePin | None:
    """A pin when any cache_control breakpoint is present, for the longest TTL asked."""
    marks = [req.cache_control]
    marks += [t.cache_control for t in req.tools or ()]
    blocks: list[wire.Block] = list(req.system) if isinstance(req.system, list) else []
    for msg in req.messages:
        if not isinstance(msg.content, str):
            blocks.extend(msg.content)
    while blocks:
        block = blocks.pop()
        marks.append(block.cache_control)
        if isinstance(block.content, list):
            blocks.extend(block.content)
    ttls = set()
    for mark in marks:
        if mark is None:
            continue
        if mark.ttl not in CACHE_TTLS:
            raise InvalidRequest(
                f"cache_control.ttl must be '5m' or '1h', not {mark.ttl!r}",
                param="cache_control.ttl",
            )
        ttls.add(CACHE_TTLS[mark.ttl])
    return CachePin(ttl=max(ttls)) if ttls else None


def _refuse_unsupported(req: wire.PromptRequest) -> None:
    if req.mcp_servers:
        raise InvalidRequest(
            "mcp_servers: this server cannot connect to MCP servers; connect them in the "
            "client instead",
            param="mcp_servers",
        )


def output_format(req: wire.PromptRequest) -> Constraint | None:
    """Structured output: output_config.format, or the beta's top-level output_format,
    {"type": "json_schema", "schema": {...}}."""
    if req.output_config is not None and req.output_config.format is not None:
        fmt, param = req.output_config.format, "output_config.format"
    elif req.output_format is not None:
        fmt, param = req.output_format, "output_format"
    else:
        return None
    return format_constraint(
        str(fmt.get("type")),
        fmt.get("schema"),
        param=param,
        schema_param=f"{param}.schema",
        kinds=("json_schema",),
    )


def prompt_plan(
    req: wire.PromptRequest,
    *,
    tools_supported: bool,
    defaults: Mapping[str, float] | None = None,
) -> ChatPlan:
    """The plan of the prompt alone (count_tokens): no output limit, no stream."""
    _refuse_unsupported(req)
    check_count(req.messages, MAX_MESSAGES, param="messages", what="messages")
    enable, effort = render_switches(req)
    return ChatPlan(
        messages=to_messages(req),
        tools=tools_of(req, supported=tools_supported),
        options=render_options(None, effort, enable_thinking=enable),
        sampling=resolve_sampling(SamplingFields(), defaults),
        max_tokens=None,
        stop=(),
        stream=False,
        pin=cache_pin(req),
        constraint=output_format(req),
    )


def chat_plan(
    req: wire.MessagesRequest,
    *,
    tools_supported: bool,
    defaults: Mapping[str, float] | None = None,
) -> ChatPlan:
    base = prompt_plan(req, tools_supported=tools_supported, defaults=defaults)
    sent = SamplingFields(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    return replace(
        base,
        sampling=resolve_sampling(sent, defaults),
        # max_tokens 0 asks to warm the cache: the prompt is still run, for one token
        max_tokens=max(req.max_tokens, 1),
        stop=stops(req.stop_sequences, param="stop_sequences"),
        stream=req.stream,
        reasoning_budget=reasoning_budget(req),
    )


def reasoning_budget(req: wire.MessagesRequest) -> int | None:
    """thinking.budget_tokens of an enabled thinking block. It may exceed max_tokens (as
    with interleaved thinking); max_tokens still bounds the whole reply."""
    thinking = req.thinking
    if thinking is None or thinking.type != "enabled" or thinking.budget_tokens is None:
        return None
    if thinking.budget_tokens < 1:
        raise InvalidRequest(
            "thinking.budget_tokens must be at least 1", param="thinking.budget_tokens"
        )
    return thinking.budget_tokens
