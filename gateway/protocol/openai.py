"""OpenAI wire models (requests). Responses are built as plain dicts in
gateway/openai_format.py and validated against the OpenAI SDK's own types in tests."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    # Unknown fields are accepted (and logged by the route); fields we know but
    # cannot honour are refused explicitly in gateway/adapters.py.
    model_config = ConfigDict(extra="allow")


class TextPart(_Wire):
    type: Literal["text", "input_text"]
    text: str


class ImageURL(_Wire):
    url: str
    detail: str | None = None


class ImagePart(_Wire):
    type: Literal["image_url"]
    image_url: ImageURL | str


class FunctionCall(_Wire):
    name: str
    arguments: str = ""


class ToolCall(_Wire):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(_Wire):
    include_usage: bool = False


class FunctionDef(_Wire):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDef


class ResponseFormat(_Wire):
    type: str


class ChatCompletionRequest(_Wire):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=None, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
