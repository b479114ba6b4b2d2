"""OpenAI Responses API wire models (requests to POST /v1/responses).

Items and tools are kept loose (one model each, with the fields of every type they
can be): the adapter dispatches on `type` and refuses what it cannot use with a
message naming the item, so a new client field is logged, never a validation error.
Response bodies and stream events are built as plain dicts in responses_emit.py and
checked against the OpenAI SDK's own types in the tests.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    # unknown fields are accepted (and logged by the route)
    model_config = ConfigDict(extra="allow")


class Part(_Wire):
    """A content part of a message or a tool output: input_text, output_text, text,
    refusal, input_image, input_file, summary_text, reasoning_text..."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | dict[str, Any] | None = None
    file_id: str | None = None
    detail: str | None = None


class Item(_Wire):
    """One input item. `type` may be left out for a message (role + content)."""

    type: str | None = None
    id: str | None = None
    status: str | None = None
    # message
    role: str | None = None
    content: str | list[Part] | None = None
    # function_call / custom_tool_call and their outputs
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    input: str | None = None
    output: str | list[Part] | dict[str, Any] | None = None  # a dict is sent as JSON text
    # reasoning
    summary: list[Part] | None = None
    encrypted_content: str | None = None


class Tool(_Wire):
    """A tool definition: function, custom, namespace (holding tools) or a hosted
    tool type, which carries fields of its own (kept as extras)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: dict[str, Any] | None = None  # custom tools: text or a grammar
    tools: list[Tool] | None = None  # namespace


class TextFormat(_Wire):
    type: str
    name: str | None = None


class TextConfig(_Wire):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Wire):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # deprecated spelling of summary


class StreamOptions(_Wire):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Wire):
    model: str | None = None  # None: the served model
    input: str | list[Item] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True  # OpenAI's default
    background: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    # a cap on calls to OpenAI's built-in tools; none runs here, so it always holds
    max_tool_calls: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # not in OpenAI's Responses API, but sent by clients that share code with chat
    # completions (and honoured by other local servers): the same meaning as there
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    client_metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # known OpenAI fields this server cannot honour: refused by name in the adapter
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
