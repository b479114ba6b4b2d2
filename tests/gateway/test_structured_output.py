"""Structured output over the wire, through the official SDKs, against a live server with
the tiny random Qwen3 (its free output is noise): chat completions' response_format
(json_schema strict or not, json_object; streamed and not), Responses' text.format,
Anthropic's output_config.format and the beta's output_format, forced tool calls; a
schema the grammar engine cannot compile is a 400 naming the keyword."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from gateway.core.models.build import build_served
from runtime.text.tokenizer import Tokenizer
from tests.support.live_server import live_server
from tests.support.schema_cases import SCHEMAS, TIME_TOOL_PARAMS, WEATHER_TOOL_PARAMS, bounded

MODEL = "tiny-qwen3"
SCHEMA = SCHEMAS["nested_object"]
NO_THINKING: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}
ASK: Any = [{"role": "user", "content": "Describe a user as JSON."}]
UNSUPPORTED: Any = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}


@pytest.fixture(scope="module")
def base_url(tiny_qwen3_dir: Path) -> Iterator[str]:
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)


def _json_schema(schema: dict[str, Any], *, strict: bool = True) -> Any:
    return {
        "type": "json_schema",
        "json_schema": {"name": "user", "schema": schema, "strict": strict},
    }


@pytest.mark.parametrize("strict", [True, False])
def test_chat_json_schema(oai: openai.OpenAI, strict: bool) -> None:
    done = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=300, seed=1,
        response_format=_json_schema(SCHEMA, strict=strict), extra_body=NO_THINKING,
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_chat_json_schema_streamed(oai: openai.OpenAI) -> None:
    schema = SCHEMAS["array_bounds"]
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=300, seed=2, stream=True,
        response_format=_json_schema(bounded(schema)), extra_body=NO_THINKING,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), schema)


class Ticket(BaseModel):
    title: Annotated[str, Field(max_length=8)]
    priority: Literal["low", "high"]
    estimate: int
    labels: Annotated[list[Literal["bug", "ui"]], Field(max_length=2)]


def test_sdk_parse_with_a_pydantic_model(oai: openai.OpenAI) -> None:
    """The SDK's own structured-output helper: a strict schema made from a model class,
    parsed back into it."""
    done = oai.chat.completions.parse(
        model=MODEL, messages=ASK, max_tokens=300, seed=3,
        response_format=Ticket, extra_body=NO_THINKING,
    )  # fmt: skip
    assert isinstance(done.choices[0].message.parsed, Ticket)


def test_chat_json_object(oai: openai.OpenAI) -> None:
    """Any JSON object (the random model's keys run on, so a short budget is cut off:
    what comes back is then a prefix of an object, never free text)."""
    done = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, seed=4,
        response_format={"type": "json_object"}, extra_body=NO_THINKING,
    )  # fmt: skip
    text = done.choices[0].message.content or ""
    assert text.startswith("{")
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_responses_text_format(oai: openai.OpenAI) -> None:
    schema: Any = SCHEMAS["enum_const"]
    done = oai.responses.create(
        model=MODEL, input="Log an event.", max_output_tokens=200,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "event", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert done.status == "completed"
    jsonschema.validate(json.loads(done.output_text), schema)


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_anthropic_output_format(claude: anthropic.Anthropic, field: str) -> None:
    schema = SCHEMAS["one_of"]
    fmt = {"type": "json_schema", "schema": schema}
    body = (
        {"output_config": {"format": fmt}} if field == "output_config" else {"output_format": fmt}
    )
    done = claude.messages.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "A shape?"}],
        thinking={"type": "disabled"}, extra_body=body,
    )  # fmt: skip
    assert done.stop_reason == "end_turn"
    text = "".join(b.text for b in done.content if b.type == "text")
    jsonschema.validate(json.loads(text), schema)


def test_uncompilable_schemas_are_a_400_naming_the_keyword(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        oai.chat.completions.create(
            model=MODEL, messages=ASK, response_format=_json_schema(UNSUPPORTED),
        )  # fmt: skip
    assert "propertyNames" in chat.value.message
    body: Any = chat.value.body
    assert body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as resp:
        oai.responses.create(
            model=MODEL, input="x",
            text={"format": {"type": "json_schema", "name": "u", "schema": UNSUPPORTED}},
        )  # fmt: skip
    assert "propertyNames" in resp.value.message
    with pytest.raises(anthropic.BadRequestError) as msg:
        claude.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}],
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": UNSUPPORTED}}},
        )  # fmt: skip
    error: Any = msg.value.body
    assert "propertyNames" in msg.value.message
    assert error["error"]["type"] == "invalid_request_error"


TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_TOOL_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_TOOL_PARAMS}},
]
ARGS = {"get_weather": WEATHER_TOOL_PARAMS, "get_time": TIME_TOOL_PARAMS}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_name_a_declared_tool_with_valid_arguments(
    oai: openai.OpenAI, choice: Any
) -> None:
    for seed in range(2):
        done = oai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=200, seed=seed, tools=TOOLS,
            tool_choice=choice, parallel_tool_calls=False,
        )  # fmt: skip
        message = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls" and message.tool_calls
        (call,) = message.tool_calls
        assert call.type == "function"
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), ARGS[call.function.name])


def test_response_format_next_to_tools_answers_or_calls(oai: openai.OpenAI) -> None:
    """With tools on auto, the model may call a tool instead of answering: either way
    the output keeps to a grammar."""
    schema = SCHEMAS["enum_const"]
    for seed in range(3):
        done = oai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=200, seed=seed, tools=TOOLS,
            response_format=_json_schema(schema), extra_body=NO_THINKING,
        )  # fmt: skip
        message = done.choices[0].message
        if message.tool_calls:
            for call in message.tool_calls:
                assert call.type == "function"
                jsonschema.validate(json.loads(call.function.arguments), ARGS[call.function.name])
        else:
            jsonschema.validate(json.loads(message.content or ""), schema)


def test_response_format_next_to_tools_can_call(oai: openai.OpenAI, tiny_qwen3_dir: Path) -> None:
    """A bias towards the call opener takes the call branch: the call that follows is
    to a declared tool, with arguments valid for it."""
    opener = Tokenizer.from_folder(tiny_qwen3_dir).token_to_id("<tool_call>")
    done = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, seed=5, tools=TOOLS,
        parallel_tool_calls=False, logit_bias={str(opener): 100},
        response_format=_json_schema(SCHEMAS["enum_const"]), extra_body=NO_THINKING,
    )  # fmt: skip
    assert done.choices[0].finish_reason == "tool_calls"
    calls = done.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    jsonschema.validate(json.loads(calls[0].function.arguments), ARGS[calls[0].function.name])


def test_auto_tool_calls_keep_to_the_call_grammar(oai: openai.OpenAI, tiny_qwen3_dir: Path) -> None:
    """tool_choice auto with no response format: the reply is free text in which a call
    the model opens (a bias makes it open one) names a declared tool with valid
    arguments; unbiased, the random model just writes text."""
    opener = Tokenizer.from_folder(tiny_qwen3_dir).token_to_id("<tool_call>")
    for seed in range(3):
        done = oai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=150, seed=seed, tools=TOOLS,
            parallel_tool_calls=False, logit_bias={str(opener): 100}, extra_body=NO_THINKING,
        )  # fmt: skip
        # after the call the random model writes noise (no second call can start)
        # until the budget ends the reply
        calls = done.choices[0].message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function"
        jsonschema.validate(json.loads(calls[0].function.arguments), ARGS[calls[0].function.name])
    free = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=30, seed=0, tools=TOOLS, extra_body=NO_THINKING,
    )  # fmt: skip
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.tool_calls


CALC_GRAMMAR = 'start: op " " NUM\nop: "add" | "sub"\nNUM: /[0-9]{1,3}/\n'


def _calc(definition: str, syntax: str = "lark") -> Any:
    return {
        "type": "custom", "name": "calc", "description": "Arithmetic.",
        "format": {"type": "grammar", "syntax": syntax, "definition": definition},
    }  # fmt: skip


@pytest.mark.parametrize("syntax", ["lark", "regex"])
def test_custom_tool_input_keeps_to_its_grammar(oai: openai.OpenAI, syntax: str) -> None:
    """A forced custom tool (Responses): its free-form input follows the tool's own
    grammar, carried as the pattern of the call's JSON string."""
    definition = CALC_GRAMMAR if syntax == "lark" else "(add|sub) [0-9]{1,3}"
    for seed in range(2):
        done = oai.responses.create(
            model=MODEL, input="Compute.", max_output_tokens=100, reasoning={"effort": "none"},
            tools=[_calc(definition, syntax)], tool_choice={"type": "custom", "name": "calc"},
            extra_body={"seed": seed},
        )  # fmt: skip
        calls = [item for item in done.output if item.type == "custom_tool_call"]
        assert calls
        for call in calls:
            assert re.fullmatch(r"(add|sub) [0-9]{1,3}", call.input), call.input


def test_uncompilable_custom_tool_grammar_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x", tools=[_calc('start: "a" undefined_rule')])
    body: Any = err.value.body
    assert body["param"] == "tools[0].format.definition"
    assert "undefined_rule" in err.value.message


def test_a_prediction_past_the_document_end_changes_nothing(oai: openai.OpenAI) -> None:
    """Predicted Outputs under a schema: the prediction is the document, then text the
    grammar refuses after its end; drafted, the refused tokens are rejected, and the
    answer is the one written without a prediction (seeded sampling, as the others)."""
    ask: Any = {"model": MODEL, "messages": ASK, "max_tokens": 300, "seed": 1,
                "response_format": _json_schema(SCHEMA), "extra_body": NO_THINKING}  # fmt: skip
    plain = oai.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    assert text is not None
    jsonschema.validate(json.loads(text), SCHEMA)
    predicted = oai.chat.completions.create(
        **ask, prediction={"type": "content", "content": text + " and then some prose."}
    )
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details if predicted.usage else None
    assert details is not None and details.accepted_prediction_tokens
    assert details.rejected_prediction_tokens  # the prose after the document's end
