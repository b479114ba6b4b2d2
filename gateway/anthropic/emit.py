"""Parser events -> Anthropic content blocks: the stream's named events, and the
message body of a non-streamed reply, built by the same state machine.

A block opens when the kind of output changes (thinking, text, a tool call) and
closes before the next opens. A thinking block ends with a `signature_delta`: our
signature carries the thinking text itself (compressed, with an integrity tag), so a
client that drops or omits the text still sends back all the next turn needs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import string
import zlib
from dataclasses import dataclass, field
from typing import Any

from parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart
from runtime.types import Finished, FinishReason, GenerationStats

log = logging.getLogger(__name__)

_ID_CHARS = string.ascii_letters + string.digits
# Not a secret: the tag shows a signature is ours and its text intact, nothing more.
_SIGNATURE_KEY = b"mlx-gateway thinking signature v1"
_SIGNATURE_PREFIX = "mlxg1."


def new_id(prefix: str) -> str:
    """An id in Anthropic's style: msg_01..., toolu_01..."""
    return prefix + "01" + "".join(secrets.choice(_ID_CHARS) for _ in range(22))


def _tag(text: str) -> str:
    return hmac.new(_SIGNATURE_KEY, text.encode("utf-8"), hashlib.sha256).hexdigest()[:32]


def signature(thinking: str) -> str:
    """A thinking block's signature: deterministic in its text, which it carries."""
    packed = base64.urlsafe_b64encode(zlib.compress(thinking.encode("utf-8"), 9)).decode()
    return f"{_SIGNATURE_PREFIX}{packed.rstrip('=')}.{_tag(thinking)}"


def thinking_from_signature(sig: str) -> str | None:
    """The text one of our signatures carries, or None (not ours, or altered)."""
    if not sig.startswith(_SIGNATURE_PREFIX):
        return None
    packed, _, tag = sig[len(_SIGNATURE_PREFIX) :].rpartition(".")
    try:
        raw = zlib.decompress(base64.urlsafe_b64decode(packed + "=" * (-len(packed) % 4)))
        text = raw.decode("utf-8")
    except (ValueError, zlib.error):
        return None
    return text if hmac.compare_digest(_tag(text), tag) else None


def usage(prompt_tokens: int, stats: GenerationStats | None, output_tokens: int) -> dict[str, Any]:
    """Anthropic's input_tokens leaves out what the cache served (cache_read); the
    prefix cache stores every prompt as a side effect, so nothing counts as a cache
    write (cache_creation is 0) and the three input counts add up to the prompt."""
    cached = stats.cached_tokens if stats is not None else 0
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_reason(done: Finished, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    if done.reason is FinishReason.LENGTH:
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if done.stop_string is not None:
        return "stop_sequence", done.stop_string
    return "end_turn", None


def sse(name: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One named SSE event; the payload's `type` repeats the name, as Anthropic's do."""
    return {"event": name, "data": json.dumps({"type": name, **payload}, ensure_ascii=False)}


@dataclass
class _Block:
    kind: str  # "text" | "thinking" | "tool_use"
    index: int
    parts: list[str] = field(default_factory=list)
    id: str = ""
    name: str = ""

    def body(self, omit_thinking: bool) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.kind == "text":
            return {"type": "text", "text": text}
        if self.kind == "thinking":
            shown = "" if omit_thinking else text
            return {"type": "thinking", "thinking": shown, "signature": signature(text)}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": _input(text)}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (a cut-off or malformed one reads as {})."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        # the arguments are model output: their text goes to debug logs only
        log.warning("tool call arguments are not valid JSON (%d chars); sending {}", len(arguments))
        log.debug("the arguments: %.200s", arguments)
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class MessageOutput:
    """One assistant message as it is generated. `feed` returns the stream events for
    the parser events; `blocks` holds them for the body. `warm_only` (max_tokens 0)
    keeps the content empty whatever was generated; `omit_thinking` (thinking.display
    "omitted") sends thinking blocks with their text only inside the signature."""

    model: str
    prompt_tokens: int
    warm_only: bool = False
    omit_thinking: bool = False
    id: str = field(default_factory=lambda: new_id("msg_"))
    blocks: list[_Block] = field(default_factory=list)
    calls: dict[int, _Block] = field(default_factory=dict)  # parser call index -> block
    open: _Block | None = None

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def start(self) -> dict[str, Any]:
        """message_start: the cache's share of the prompt is known only at the end."""
        message = {
            **self._envelope(),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(self.prompt_tokens, None, 0),
        }
        return sse("message_start", {"message": message})

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.warm_only:
            return out
        for ev in events:
            out.extend(self._one(ev))
        return out

    def _one(self, ev: Event) -> list[dict[str, Any]]:
        if isinstance(ev, (Content, Reasoning)):
            kind, key, delta = (
                ("text", "text", "text_delta")
                if isinstance(ev, Content)
                else ("thinking", "thinking", "thinking_delta")
            )
            out = [] if self.open and self.open.kind == kind else self._open_block(kind)
            assert self.open is not None
            self.open.parts.append(ev.text)
            if kind == "thinking" and self.omit_thinking:
                return out  # the text goes out only inside the signature
            return [*out, self._delta({"type": delta, key: ev.text})]
        if isinstance(ev, ToolCallStart):
            out = self._open_block("tool_use", name=ev.name)
            assert self.open is not None
            self.calls[ev.index] = self.open
            return out
        if isinstance(ev, ToolCallArgs):
            block = self.calls.get(ev.index)
            if block is None:
                return []
            block.parts.append(ev.fragment)
            if block is not self.open:  # parsers finish one call before the next
                log.warning("arguments for a tool call that is already closed")
                return []
            return [self._delta({"type": "input_json_delta", "partial_json": ev.fragment})]
        assert isinstance(ev, ToolCallEnd)
        block = self.calls.get(ev.index)
        return self.close() if block is not None and block is self.open else []

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        assert self.open is not None
        return sse("content_block_delta", {"index": self.open.index, "delta": delta})

    def _open_block(self, kind: str, name: str = "") -> list[dict[str, Any]]:
        out = self.close()
        block = _Block(kind, len(self.blocks), name=name)
        if kind == "tool_use":
            block.id = new_id("toolu_")
        self.blocks.append(block)
        self.open = block
        start: dict[str, Any] = {"type": kind}
        if kind == "text":
            start["text"] = ""
        elif kind == "thinking":
            start.update(thinking="", signature="")
        else:
            start.update(id=block.id, name=name, input={})
        return [*out, sse("content_block_start", {"index": block.index, "content_block": start})]

    def close(self) -> list[dict[str, Any]]:
        """Close the open block, if any (a thinking block sends its signature first)."""
        block, self.open = self.open, None
        if block is None:
            return []
        out = []
        if block.kind == "thinking":
            sig = signature("".join(block.parts))
            delta = {"type": "signature_delta", "signature": sig}
            out.append(sse("content_block_delta", {"index": block.index, "delta": delta}))
        out.append(sse("content_block_stop", {"index": block.index}))
        return out

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def _ending(self, done: Finished) -> tuple[str, str | None, dict[str, Any]]:
        reason, sequence = stop_reason(done, self.has_calls)
        if self.warm_only:
            reason, sequence = "max_tokens", None
        output = 0 if self.warm_only else done.stats.completion_tokens
        return reason, sequence, usage(self.prompt_tokens, done.stats, output)

    def delta(self, done: Finished) -> dict[str, Any]:
        """message_delta: how it stopped, and the final usage (cumulative)."""
        reason, sequence, totals = self._ending(done)
        return sse(
            "message_delta",
            {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": totals},
        )

    def body(self, done: Finished) -> dict[str, Any]:
        """The non-streamed message."""
        reason, sequence, totals = self._ending(done)
        return {
            **self._envelope(),
            "content": [b.body(self.omit_thinking) for b in self.blocks],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": totals,
        }


def stop_event() -> dict[str, Any]:
    return sse("message_stop", {})
