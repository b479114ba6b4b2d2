"""Wire requests -> neutral values: template messages, sampling params, stops.

Every field is either turned into something the runtime honours or refused with
an InvalidRequest naming it; nothing is silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.core.limits import MAX_MESSAGES, check_count
from gateway.core.plan import (
    CachePin,
    ChatPlan,
    ToolPlan,
    render_options,
    resolve_sampling,
    sent_sampling,
    stops,
)
from gateway.core.plan import tool_plan as neutral_tool_plan
from gateway.core.structured import format_constraint
from gateway.openai import wire
from runtime.types import Constraint, SamplingParams
from templates.types import ImagePart, Message, TextPart, Tool, ToolCall

_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
_IMAGE_PARTS = frozenset({"image_url", "input_image"})


def _missing(where: str, kind: str, field: str) -> InvalidRequest:
    return InvalidRequest(f"{where} has type {kind!r} but no {field!r}", param=f"{where}.{field}")


def _part(part: wire.ContentPart, where: str) -> TextPart | ImagePart:
    kind = part.type
    if kind in _TEXT_PARTS:
        if part.text is None:
            raise _missing(where, kind, "text")
        return TextPart(part.text)
    if kind == "refusal":
        if part.refusal is None:
            raise _missing(where, kind, "refusal")
        return TextPart(part.refusal)
    if kind in _IMAGE_PARTS:
        if part.image_url is None:
            raise _missing(where, kind, "image_url")
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        return ImagePart(url)
    raise InvalidRequest(
        f"{where} has type {kind!r}, which this server cannot read; send text parts "
        "(or image_url parts to a model with vision)",
        param=f"{where}.type",
    )


def content_part(part: wire.ContentPart, where: str) -> TextPart | ImagePart:
    """One text, refusal or image part, for every OpenAI dialect (chat and Responses)."""
    return _part(part, where)


def _content(msg: wire.ChatMessage, index: int) -> str | tuple[TextPart | ImagePart, ...] | None:
    if msg.content is None:
        if msg.role == "assistant":
            return msg.refusal  # null content is fine next to tool_calls (or a refusal)
        raise InvalidRequest(
            f"messages[{index}] (role {msg.role!r}) has no content",
            param=f"messages[{index}].content",
        )
    if isinstance(msg.content, str):
        return msg.content
    parts = [_part(p, f"messages[{index}].content[{j}]") for j, p in enumerate(msg.content)]
    if all(isinstance(p, TextPart) for p in parts):
        # text parts join with nothing between them, as OpenAI concatenates them
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return tuple(parts)


def _tool_calls(msg: wire.ChatMessage, index: int) -> tuple[ToolCall, ...]:
    calls = []
    for j, call in enumerate(msg.tool_calls or ()):
        args = call.function.arguments or "{}"
        try:
            json.loads(args)
        except json.JSONDecodeError:
            raise InvalidRequest(
                f"messages[{index}].tool_calls[{j}].function.arguments is not valid JSON",
                param=f"messages[{index}].tool_calls[{j}].function.arguments",
            ) from None
        calls.append(ToolCall(id=call.id, name=call.function.name, arguments=args))
    return tuple(calls)


def to_messages(messages: list[wire.ChatMessage]) -> tuple[Message, ...]:
    out = []
    for i, msg in enumerate(messages):
        if msg.role == "tool" and not msg.tool_call_id:
            raise InvalidRequest(
                f"messages[{i}] has role 'tool' but no tool_call_id",
                param=f"messages[{i}].tool_call_id",
            )
        role = "system" if msg.role == "developer" else msg.role
        out.append(
            Message(
                role=role,
                content=_content(msg, i),
                name=msg.name,
                tool_calls=_tool_calls(msg, i),
                tool_call_id=msg.tool_call_id,
                reasoning=msg.reasoning_content or msg.reasoning,
            )
        )
    return tuple(out)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id", param="logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                param="logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise InvalidRequest(
                "logit_bias values must be between -100 and 100", param="logit_bias"
            )
        out[token] = float(value)
    return out


def sampling_params(
    req: wire.SamplingFields,
    vocab_size: int,
    defaults: Mapping[str, float] | None = None,
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> SamplingParams:
    """`defaults`: the model's recommended sampling, for fields the request leaves out."""
    sent = sent_sampling(
        req,
        logit_bias=MappingProxyType(_logit_bias(req.logit_bias, vocab_size)),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    return resolve_sampling(sent, defaults)


def _chat_sampling(
    req: wire.ChatCompletionRequest, vocab_size: int, defaults: Mapping[str, float] | None
) -> SamplingParams:
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    return sampling_params(
        req, vocab_size, defaults, logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0
    )


def _tool_choice(choice: str | dict[str, Any] | None, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"tool_choice {choice!r} is not one of none, auto, required or a named function",
                param="tool_choice",
            )
        if choice == "required" and not names:
            raise InvalidRequest(
                "tool_choice 'required' needs a non-empty tools list", param="tools"
            )
        return (choice if names else "none"), None
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest(
            'a named tool_choice must look like {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return "named", name


def tool_plan(
    tools: list[wire.ToolDef] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    *,
    supported: bool,
) -> ToolPlan:
    tools = tools or []
    choice, name = _tool_choice(tool_choice, {t.function.name for t in tools})
    rendered = tuple(
        Tool(t.function.name, t.function.description, MappingProxyType(t.function.parameters or {}))
        for t in tools
    )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return neutral_tool_plan(rendered, choice, name, parallel, supported=supported)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _refuse(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", param=param, code="unsupported_parameter")


def _refuse_unsupported(req: wire.ChatCompletionRequest) -> None:
    """Known OpenAI fields this server cannot honour: a 400 naming each, never ignored."""
    if req.store:
        raise _refuse("store", "this server does not store completions; send store: false")
    if req.audio is not None or any(m != "text" for m in req.modalities or ()):
        param = "modalities" if req.audio is None else "audio"
        raise _refuse(param, "this server writes text only")
    if req.functions is not None or req.function_call is not None:
        param = "functions" if req.functions is not None else "function_call"
        raise _refuse(param, "the deprecated functions API is not served; send tools")
    if req.web_search_options is not None:
        raise _refuse("web_search_options", "this server has no web search")
    if req.verbosity not in (None, "medium"):
        raise _refuse("verbosity", "only the default 'medium' is honoured")
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise InvalidRequest(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
            param="reasoning_effort",
        )


def response_format(fmt: wire.ResponseFormat | None) -> Constraint | None:
    """response_format: "text" (free), "json_object" (any JSON object) or "json_schema"
    ({"json_schema": {"name", "schema", "strict"}}: a document valid against the schema,
    strict or not; without a schema, any object)."""
    if fmt is None:
        return None
    spec = (fmt.model_extra or {}).get("json_schema") if fmt.type == "json_schema" else None
    if fmt.type == "json_schema" and not isinstance(spec, dict):
        raise InvalidRequest(
            "response_format of type 'json_schema' needs a json_schema object "
            '({"name": ..., "schema": {...}})',
            param="response_format.json_schema",
        )
    return format_constraint(
        fmt.type,
        spec.get("schema") if spec else None,
        param="response_format",
        schema_param="response_format.json_schema.schema",
        kinds=("text", "json_object", "json_schema"),
    )


def chat_plan(
    req: wire.ChatCompletionRequest,
    *,
    vocab_size: int,
    tools_supported: bool,
    defaults: Mapping[str, float] | None = None,
) -> ChatPlan:
    _refuse_unsupported(req)
    check_count(req.messages, MAX_MESSAGES, param="messages", what="messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    return ChatPlan(
        messages=to_messages(req.messages),
        tools=tool_plan(
            req.tools, req.tool_choice, req.parallel_tool_calls, supported=tools_supported
        ),
        options=render_options(req.chat_template_kwargs, req.reasoning_effort),
        sampling=_chat_sampling(req, vocab_size, defaults),
        max_tokens=max_tokens,
        stop=stops(req.stop),
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        n=req.n or 1,
        max_tokens_field="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        pin=CachePin(key=req.prompt_cache_key) if req.prompt_cache_key else None,
        constraint=response_format(req.response_format),
        prediction=_prediction(req.prediction),
    )


def _prediction(prediction: wire.Prediction | None) -> str | None:
    """Predicted Outputs' text: `{"type": "content", "content": text or text parts}`."""
    if prediction is None:
        return None
    if prediction.type != "content":
        raise InvalidRequest(
            f"prediction type {prediction.type!r} is not supported; send "
            '{"type": "content", "content": "..."}',
            param="prediction.type",
        )
    if isinstance(prediction.content, str):
        return prediction.content
    if any(p.type != "text" or p.text is None for p in prediction.content):
        raise InvalidRequest(
            "prediction content parts must be text parts", param="prediction.content"
        )
    return "".join(p.text or "" for p in prediction.content)


# -- /v1/completions -------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionPlan:
    prompts: tuple[str | tuple[int, ...], ...]  # text to encode, or token ids as sent
    sampling: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int
    best_of: int  # generations per prompt; the best n (by mean token logprob) are returned
    echo: bool
    logprobs: int | None  # legacy: how many alternatives per token; None = no logprobs


DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


Prompt = str | tuple[int, ...]


def _prompts(
    prompt: str | list[str] | list[int] | list[list[int]], vocab_size: int
) -> tuple[Prompt, ...]:
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [[p for p in prompt if isinstance(p, int)]]
    else:
        items = [p for p in prompt if isinstance(p, (str, list))]
    if not items:
        raise InvalidRequest("prompt is empty; send a string, strings or token ids", param="prompt")
    out: list[Prompt] = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            out.append(item)
            continue
        if not item:
            raise InvalidRequest(f"{where} is an empty list of token ids", param=where)
        bad = next((t for t in item if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"{where} holds token id {bad}, outside the vocabulary (0..{vocab_size - 1})",
                param=where,
            )
        out.append(tuple(item))
    return tuple(out)


def _choices(req: wire.CompletionRequest) -> tuple[int, int]:
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise InvalidRequest(f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > n and req.stream:
        raise InvalidRequest("best_of cannot be used with stream: true", param="best_of")
    return n, best_of


def completion_plan(
    req: wire.CompletionRequest, *, vocab_size: int, defaults: Mapping[str, float] | None = None
) -> CompletionPlan:
    if req.suffix:
        raise _refuse("suffix", "insertion (fill-in-the-middle) is not supported yet")
    n, best_of = _choices(req)
    max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise InvalidRequest(
            "max_tokens 0 generates nothing; use it with echo: true", param="max_tokens"
        )
    if req.echo and req.logprobs is not None:
        raise _refuse("echo", "with logprobs it asks for the prompt's logprobs, not computed here")
    # best_of ranks candidates by their own logprobs, so they are computed then too
    want = req.logprobs is not None or best_of > n
    return CompletionPlan(
        prompts=_prompts(req.prompt, vocab_size),
        sampling=sampling_params(
            req, vocab_size, defaults, logprobs=want, top_logprobs=req.logprobs or 0
        ),
        max_tokens=max_tokens,
        stop=stops(req.stop),
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        n=n,
        best_of=best_of,
        echo=req.echo,
        logprobs=req.logprobs,
    )
