"""OpenAI wire models (requests). Responses are built as plain dicts in
gateway/openai/emit.py and validated against the OpenAI SDK's own types in tests."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16


class _Wire(BaseModel):
    # Unknown fields are accepted (and logged by the route); fields we know but
    # cannot honour are refused explicitly in gateway/openai/adapt.py.
    model_config = ConfigDict(extra="allow")


class ImageURL(_Wire):
    url: str
    detail: str | None = None


class ContentPart(_Wire):
    """One part of a message's content. Every type parses here, so the adapter can
    refuse the ones it cannot use with a message naming the part."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: ImageURL | str | None = None


class FunctionCall(_Wire):
    name: str
    arguments: str = ""


class ToolCall(_Wire):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None


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


class SamplingFields(_Wire):
    """Fields shared by chat and text completions that become SamplingParams."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None


class Prediction(_Wire):
    """Predicted Outputs: text the reply is expected to repeat (a file sent back with
    an edit); drafted from, so matching tokens cost a fraction of a step."""

    type: str
    content: str | list[ContentPart]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None  # pins the prompt's prefix in the cache
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prediction: Prediction | None = None
    # known OpenAI fields this server cannot honour: refused by name in the adapter
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    # 0 is allowed with echo: the prompt comes back and nothing is generated
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)


class TokenizeRequest(_Wire):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Wire):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Wire):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None  # None: float
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's: cut each input to this many tokens (-1: to the model's limit) instead of
    # refusing one that is too long
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
