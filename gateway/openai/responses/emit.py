"""Parser events -> a Responses object and its stream events.

One `ResponseBuilder` follows one generation. Streamed, its events go out as SSE with
an `event:` line naming each; not streamed, only the final object is used. Output
items appear in the order the model wrote them: reasoning (`rs_`), a message (`msg_`)
with one output_text part, function calls (`fc_`, arguments streamed as written) and
custom tool calls (`ctc_`, whose input is sent whole when the call ends: the model
writes it as a JSON string argument, which is only decoded once complete).

Reasoning: the item's content holds the text (`reasoning_text` events). When the
request asks for a summary (`reasoning.summary`), the summary is the reasoning text
itself, one summary part streamed alongside: a local model writes no separate
summary. With include `reasoning.encrypted_content`, the finished item carries the
text sealed by this server (see responses_store.ReasoningSeal).
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.core.errors import APIError
from gateway.core.plan import ChatPlan
from gateway.core.reply import Reply
from gateway.openai.responses.tools import ToolNames, ToolRef
from gateway.openai.responses.wire import ResponsesRequest
from parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart
from runtime.types import FinishReason

Payload = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def envelope(req: ResponsesRequest, model: str, plan: ChatPlan) -> Payload:
    """The response object before any output: the request's settings as applied."""
    reasoning = req.reasoning
    verbosity = req.text.verbosity if req.text and req.text.verbosity else "medium"
    choice = req.tool_choice if req.tool_choice is not None else plan.tools.choice
    return {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": model,
        "output": [],
        "parallel_tool_calls": plan.tools.parallel,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None,
        },
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.store,
        "temperature": plan.sampling.temperature,
        "text": {"format": {"type": "text"}, "verbosity": verbosity},
        "tool_choice": choice,
        "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or ()],
        "top_p": plan.sampling.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def usage(reply: Reply) -> Payload:
    stats = reply.stats
    return {
        "input_tokens": stats.prompt_tokens,
        # every cached token here was reused implicitly; none is written on request
        "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": stats.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens},
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


def custom_input(arguments: str) -> str:
    """A custom tool's input from the {"input": ...} arguments the model wrote."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(args, dict):
        if isinstance(args.get("input"), str):
            return str(args["input"])
        values = list(args.values())
        if len(values) == 1 and isinstance(values[0], str):
            return values[0]  # the model named the one argument differently
    return arguments


@dataclass
class _Item:
    index: int  # output_index
    item: Payload
    text: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def id(self) -> str:
        return str(self.item["id"])

    @property
    def kind(self) -> str:
        return str(self.item["type"])

    @property
    def joined(self) -> str:
        return "".join(self.text)


class ResponseBuilder:
    """Builds one response from parser events; each method returns the stream events
    (payload dicts with `type` and `sequence_number`) its step produced."""

    def __init__(
        self,
        body: Payload,
        names: ToolNames,
        *,
        summary: bool = False,
        seal: Callable[[str], str] | None = None,
    ) -> None:
        self.body = body
        self._names = names
        self._summary = summary
        self._seal = seal
        self._seq = 0
        self._open: _Item | None = None  # the reasoning or message item being written
        self._calls: dict[int, _Item] = {}  # the parser's call index -> its item
        self.started = False

    # -- events ------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Payload:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return payload

    def _snapshot(self) -> Payload:
        return copy.deepcopy(self.body)

    def start(self) -> list[Payload]:
        self.started = True
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def feed(self, events: list[Event]) -> list[Payload]:
        out: list[Payload] = []
        for ev in events:
            if isinstance(ev, Reasoning):
                out += self._reasoning(ev.text)
            elif isinstance(ev, Content):
                out += self._content(ev.text)
            elif isinstance(ev, ToolCallStart):
                out += self._call_start(ev)
            elif isinstance(ev, ToolCallArgs):
                out += self._call_args(ev)
            elif isinstance(ev, ToolCallEnd):
                out += self._call_end(ev.index, "completed")
        return out

    # -- items -------------------------------------------------------------------------

    def _add(self, item: Payload) -> tuple[_Item, Payload]:
        added = _Item(len(self.body["output"]), item)
        self.body["output"].append(item)
        return added, self._event(
            "response.output_item.added", output_index=added.index, item=copy.deepcopy(item)
        )

    def _where(self, item: _Item) -> Payload:
        return {"item_id": item.id, "output_index": item.index}

    def _reasoning(self, text: str) -> list[Payload]:
        out: list[Payload] = []
        if self._open is not None and self._open.kind != "reasoning":
            out += self._close("completed")
        if self._open is None:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            self._open, added = self._add(item)
            out.append(added)
            where = self._where(self._open)
            if self._summary:
                part = {"type": "summary_text", "text": ""}
                out.append(
                    self._event(
                        "response.reasoning_summary_part.added", **where, summary_index=0, part=part
                    )
                )
            part = {"type": "reasoning_text", "text": ""}
            out.append(
                self._event("response.content_part.added", **where, content_index=0, part=part)
            )
        where = self._where(self._open)
        self._open.text.append(text)
        out.append(
            self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)
        )
        if self._summary:
            out.append(
                self._event(
                    "response.reasoning_summary_text.delta", **where, summary_index=0, delta=text
                )
            )
        return out

    def _content(self, text: str) -> list[Payload]:
        out: list[Payload] = []
        if self._open is not None and self._open.kind != "message":
            out += self._close("completed")
        if self._open is None:
            item = {
                "id": new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            self._open, added = self._add(item)
            out.append(added)
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(
                self._event(
                    "response.content_part.added", **self._where(self._open), content_index=0,
                    part=part,
                )
            )  # fmt: skip
        self._open.text.append(text)
        out.append(
            self._event(
                "response.output_text.delta", **self._where(self._open), content_index=0,
                delta=text, logprobs=[],
            )
        )  # fmt: skip
        return out

    def _close(self, status: str) -> list[Payload]:
        """Finish the open reasoning or message item."""
        item, self._open = self._open, None
        if item is None:
            return []
        text, where = item.joined, self._where(item)
        if item.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            item.item.update(status=status, content=[part])
            out = [
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            out = self._close_reasoning(item, status)
        out.append(
            self._event(
                "response.output_item.done", output_index=item.index, item=copy.deepcopy(item.item)
            )
        )
        return out

    def _close_reasoning(self, item: _Item, status: str) -> list[Payload]:
        text, where = item.joined, self._where(item)
        part = {"type": "reasoning_text", "text": text}
        out = [
            self._event("response.reasoning_text.done", **where, content_index=0, text=text),
            self._event("response.content_part.done", **where, content_index=0, part=part),
        ]
        item.item.update(content=[part], status=status)
        if self._summary:
            summary = {"type": "summary_text", "text": text}
            item.item["summary"] = [summary]
            out += [
                self._event(
                    "response.reasoning_summary_text.done", **where, summary_index=0, text=text
                ),
                self._event(
                    "response.reasoning_summary_part.done", **where, summary_index=0, part=summary
                ),
            ]
        if self._seal is not None:
            item.item["encrypted_content"] = self._seal(text)
        return out

    def _ref(self, name: str) -> ToolRef:
        return self._names.get(name) or ToolRef("function", name)

    def _call_start(self, ev: ToolCallStart) -> list[Payload]:
        out = self._close("completed")
        ref = self._ref(ev.name)
        extra = {"namespace": ref.namespace} if ref.namespace else {}
        if ref.kind == "custom":
            item = {"id": new_id("ctc"), "type": "custom_tool_call", "call_id": ev.id,
                    "name": ref.name, "input": "", **extra}  # fmt: skip
        else:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": ev.id,
                    "name": ref.name, "arguments": "", "status": "in_progress", **extra}  # fmt: skip
        self._calls[ev.index], added = self._add(item)
        out.append(added)
        return out

    def _call_args(self, ev: ToolCallArgs) -> list[Payload]:
        call = self._calls.get(ev.index)
        if call is None or call.done:
            return []
        call.text.append(ev.fragment)
        if call.kind == "custom_tool_call":
            return []  # the input is decoded from the arguments once the call ends
        return [
            self._event(
                "response.function_call_arguments.delta", **self._where(call), delta=ev.fragment
            )
        ]

    def _call_end(self, index: int, status: str) -> list[Payload]:
        call = self._calls.get(index)
        if call is None or call.done:
            return []
        call.done = True
        where = self._where(call)
        if call.kind == "custom_tool_call":
            text = custom_input(call.joined)
            call.item["input"] = text
            out = [
                self._event("response.custom_tool_call_input.delta", **where, delta=text),
                self._event("response.custom_tool_call_input.done", **where, input=text),
            ]
        else:
            args = call.joined or "{}"
            call.item.update(arguments=args, status=status)
            out = [self._event("response.function_call_arguments.done", **where, arguments=args)]
        out.append(
            self._event(
                "response.output_item.done", output_index=call.index, item=copy.deepcopy(call.item)
            )
        )
        return out

    # -- the end -----------------------------------------------------------------------

    def finish(self, reply: Reply) -> list[Payload]:
        """The generation ended (stop or length): close what is open, then
        response.completed, or response.incomplete when the output was cut short."""
        assert reply.done is not None
        cut = reply.done.reason is FinishReason.LENGTH
        status = "incomplete" if cut else "completed"
        out = self._close(status)
        for index in sorted(self._calls):
            out += self._call_end(index, "incomplete")
        self.body.update(
            status=status,
            usage=usage(reply),
            completed_at=int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
        )
        kind = "response.incomplete" if cut else "response.completed"
        out.append(self._event(kind, response=self._snapshot()))
        return out

    def failed(self, err: APIError) -> list[Payload]:
        """An error after the stream began: response.failed with the error in the
        response (an `error` event if not even response.created went out)."""
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        if not self.started:
            return [self._event("error", code=code, message=err.message, param=err.param)]
        error = {"code": code, "message": err.message, "type": err.type, "param": err.param}
        self.body.update(status="failed", error=error)
        return [self._event("response.failed", response=self._snapshot())]
