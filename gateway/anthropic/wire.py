"""Anthropic Messages wire models (requests). Response bodies and stream events are
built as plain dicts in gateway/anthropic/emit.py and checked against the Anthropic
SDK's own types in the tests.

Every model accepts unknown fields (new SDK versions add some every month); the
route logs the top-level ones. Content blocks are one loose model, so the adapter can
name a block it cannot use instead of failing on a union it cannot pick a branch of.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


class CacheControl(_Wire):
    type: str = "ephemeral"
    ttl: str | None = None  # "5m" (the default) or "1h"


class Source(_Wire):
    """An image (or document) source: base64 data, a URL, or an uploaded file."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None


class Block(_Wire):
    """One content block of any type; the adapter reads the fields its type uses."""

    type: str
    cache_control: CacheControl | None = None
    text: str | None = None  # text
    source: Source | str | None = None  # image, document (search_result: a string)
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    # tool_result: text or blocks; Anthropic's own tool results may hold an object
    content: str | list[Block] | dict[str, Any] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    data: str | None = None  # redacted_thinking


class InputMessage(_Wire):
    # "system" is not in Anthropic's schema, but Claude Code sends system turns
    # between (and after) the others
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDef(_Wire):
    """A custom tool (type absent or "custom"), or one of Anthropic's own tools
    (web_search_20250305, bash_20250124, ...), which this server leaves out."""

    name: str | None = None
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # the reasoning block is closed after this many tokens
    display: str | None = None


class OutputConfig(_Wire):
    effort: str | None = None
    format: dict[str, Any] | None = None


class ContextEdit(_Wire):
    type: str
    keep: str | dict[str, Any] | None = None


class ContextManagement(_Wire):
    edits: list[ContextEdit] = Field(default_factory=list)


class Metadata(_Wire):
    user_id: str | None = None


class PromptRequest(_Wire):
    """The fields that shape the prompt: shared by messages and count_tokens."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # structured outputs beta (now output_config)
    context_management: ContextManagement | None = None
    cache_control: CacheControl | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    # accepted and deliberately ignored: they mean nothing on a local server
    metadata: Metadata | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(PromptRequest):
    # 0 is Anthropic's "warm the prompt cache, generate nothing"
    max_tokens: int = Field(ge=0)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)


class CountTokensRequest(PromptRequest):
    pass
