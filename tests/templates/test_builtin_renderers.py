"""Built-in renderers, checked against the official chat templates.

Where the official template is here (the npm tokenizer packages for Qwen3, Llama 3 and
DeepSeek-V3; the Qwen2.5-Coder GGUF), a built-in's output must equal what the template
renders through `HFTemplateRenderer`, over a named corpus and over random conversations.
The families whose templates are not here (Qwen3-Coder, Qwen3.5, GLM-4.7, DeepSeek-V3.1,
Llama 3.1) are pinned by golden strings rendered with their published templates (each
module's docstring names its source).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from templates import (
    HFTemplateRenderer,
    ImagePart,
    Message,
    MissingTemplateRenderer,
    Renderer,
    RenderOptions,
    TemplateError,
    TextPart,
    Tool,
    ToolCall,
    builtin_families,
    builtin_model_types,
    builtin_renderer,
    renderer_for,
)
from tests.support.gguf_metadata import gguf_metadata

# --- official templates -----------------------------------------------------------------------


@dataclass(frozen=True)
class Official:
    template: str
    bos_token: str | None
    eos_token: str | None

    def renderer(self) -> HFTemplateRenderer:
        return HFTemplateRenderer(self.template, bos_token=self.bos_token, eos_token=self.eos_token)


def _token(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _from_npm(folder: Path) -> Official:
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    return Official(
        config["chat_template"], _token(config.get("bos_token")), _token(config.get("eos_token"))
    )


@pytest.fixture(scope="session")
def qwen25_official(qwen25_gguf: Path) -> Official:
    template = gguf_metadata(qwen25_gguf)["tokenizer.chat_template"]
    return Official(template, None, "<|im_end|>")


# family -> fixture giving its official template
_OFFICIAL_FIXTURES = {
    "qwen3": "qwen3_tokenizer_dir",
    "qwen2.5": "qwen25_official",
    "llama3.0": "llama3_tokenizer_dir",
    "deepseek-v3": "deepseek_v3_tokenizer_dir",
}


@pytest.fixture(scope="module", params=sorted(_OFFICIAL_FIXTURES))
def family(request: pytest.FixtureRequest) -> tuple[str, Official]:
    name: str = request.param
    value = request.getfixturevalue(_OFFICIAL_FIXTURES[name])
    return name, value if isinstance(value, Official) else _from_npm(value)


def _builtin(name: str, official: Official) -> Renderer:
    return builtin_renderer(name, bos_token=official.bos_token, eos_token=official.eos_token)


def _render(renderer: Renderer, messages: Any, tools: Any, options: RenderOptions) -> Any:
    try:
        return renderer.render(messages, tools, options)
    except TemplateError as exc:
        return exc


def _compare(name: str, official: Official, messages: Any, tools: Any, opts: Any) -> None:
    """Built-in == official, where the built-in deliberately refuses nothing."""
    expected = _render(official.renderer(), messages, tools, opts)
    actual = _render(_builtin(name, official), messages, tools, opts)
    if isinstance(expected, TemplateError):
        assert isinstance(actual, TemplateError), f"{name}: official raised {expected}"
    else:
        assert actual == expected, name


# --- the corpus ---------------------------------------------------------------------------------

WEATHER = Tool(
    "get_weather",
    " Current weather for a city. Returns <json> & 'quotes'.\n",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            "days": {"type": ["integer", "null"], "minimum": 1},
        },
        "required": ["city"],
    },
)
CLOCK = Tool("get_time", None, {"type": "object", "properties": {}})
CALLS = (
    ToolCall("call_1", "get_weather", '{"city": "Zürich", "unit": "c", "days": 2}'),
    ToolCall("call_2", "get_time", "{}"),
)
ODD_ARGS = ToolCall("call_3", "get_weather", '{"city":"a\\nb","opts":{"x":true},"n":null}')

CASES: dict[str, tuple[tuple[Message, ...], tuple[Tool, ...]]] = {
    "single_user": ((Message("user", "Hello!"),), ()),
    "system_multi_turn": (
        (
            Message("system", "You are terse."),
            Message("user", "What is 2+2?"),
            Message("assistant", "4"),
            Message("user", "  And 3+3?\n"),
        ),
        (),
    ),
    "consecutive_users": ((Message("user", "first"), Message("user", "second")), ()),
    "unicode_and_parts": ((Message("user", (TextPart("Grüße 🌍 "), TextPart("<b>&</b>"))),), ()),
    "tools_parallel_calls": (
        (
            Message("system", "Use tools."),
            Message("user", "Weather in Zürich and the time?"),
            Message("assistant", None, tool_calls=CALLS),
            Message("tool", '{"temp": 21}', tool_call_id="call_1"),
            Message("tool", "12:00", tool_call_id="call_2"),
            Message("assistant", "It is 21 °C at noon."),
            Message("user", "Thanks"),
        ),
        (WEATHER, CLOCK),
    ),
    "tool_call_with_text_pending_result": (
        (
            Message("user", "Weather?"),
            Message("assistant", "Let me check.", tool_calls=(ODD_ARGS,)),
            Message("tool", "sunny", tool_call_id="call_3"),
        ),
        (WEATHER,),
    ),
    "reasoning_history": (
        (
            Message("user", "Think about 2+2."),
            Message("assistant", "4", reasoning="2 plus 2 is 4."),
            Message("user", "And 3+3?"),
            Message("assistant", "<think>\n3 plus 3\n</think>\n\n6"),
        ),
        (),
    ),
    "reasoning_in_tool_loop": (
        (
            Message("user", "Time?"),
            Message("assistant", "", reasoning="Use the clock.", tool_calls=CALLS[1:]),
            Message("tool", "12:00", tool_call_id="call_2"),
            Message("assistant", "Noon.", reasoning="It said 12:00."),
        ),
        (CLOCK,),
    ),
}
OPTIONS = tuple(
    RenderOptions(add_generation_prompt=gen, enable_thinking=thinking)
    for gen, thinking in itertools.product((True, False), (None, True, False))
)


def _has_tools(case: str) -> bool:
    messages, tools = CASES[case]
    return bool(tools) or any(m.tool_calls for m in messages)


@pytest.mark.parametrize("case", sorted(CASES))
def test_builtin_matches_official(family: tuple[str, Official], case: str) -> None:
    name, official = family
    messages, tools = CASES[case]
    for options in OPTIONS:
        if name == "deepseek-v3":
            # The V3 template ignores tool definitions; the built-in refuses them.
            _compare(name, official, messages, (), options)
        elif name == "llama3.0" and _has_tools(case):
            # Llama 3.0 has no tool format: its template drops calls, the built-in refuses.
            with pytest.raises(TemplateError, match="no tool calling"):
                _builtin(name, official).render(messages, tools, options)
        else:
            _compare(name, official, messages, tools, options)


def test_deepseek_v3_refuses_tool_definitions(deepseek_v3_tokenizer_dir: Path) -> None:
    renderer = _builtin("deepseek-v3", _from_npm(deepseek_v3_tokenizer_dir))
    with pytest.raises(TemplateError, match=r"deepseek-v3\.1"):
        renderer.render([Message("user", "hi")], (WEATHER,), RenderOptions())


# --- random conversations -------------------------------------------------------------------------

_TEXTS = st.sampled_from(
    ["Hello!", "", " padded \n", "multi\nline", "<tool_response>\nx\n</tool_response>", "é <b>"]
)
_ARGUMENTS = st.sampled_from(['{"city": "Rome"}', "{}", '{"a": [1, {"b": null}]}', "not json"])


@st.composite
def _conversations(draw: st.DrawFn) -> tuple[Message, ...]:
    out: list[Message] = []
    if draw(st.booleans()):
        out.append(Message("system", draw(_TEXTS)))
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["user", "assistant", "calls", "tool", "system"]))
        if kind == "calls":
            names = draw(
                st.lists(st.sampled_from(["get_weather", "get_time"]), min_size=1, max_size=3)
            )
            calls = tuple(ToolCall(f"c{i}", n, draw(_ARGUMENTS)) for i, n in enumerate(names))
            content = draw(st.one_of(st.none(), _TEXTS))
            out.append(Message("assistant", content, tool_calls=calls))
            out.extend(Message("tool", draw(_TEXTS), tool_call_id=c.id) for c in calls)
        elif kind == "assistant":
            reasoning = draw(st.one_of(st.none(), _TEXTS))
            out.append(Message("assistant", draw(_TEXTS), reasoning=reasoning))
        else:
            out.append(Message(kind, draw(_TEXTS)))
    return tuple(out)


_OPTION_CHOICES = st.sampled_from(
    [*OPTIONS, RenderOptions(extra={"enable_thinking": False}), RenderOptions(extra={"x": 1})]
)


@settings(max_examples=60, deadline=None)
@given(messages=_conversations(), with_tools=st.booleans(), options=_OPTION_CHOICES)
def test_builtin_matches_official_on_random_conversations(
    family: tuple[str, Official],
    messages: tuple[Message, ...],
    with_tools: bool,
    options: RenderOptions,
) -> None:
    name, official = family
    if name == "llama3.0" and any(m.tool_calls for m in messages):
        return  # refused by design, checked above
    tools = (WEATHER, CLOCK) if with_tools and name not in ("deepseek-v3", "llama3.0") else ()
    _compare(name, official, messages, tools, options)


# --- DeepSeek-V3.1 agrees with V3 where their formats coincide --------------------------------------


@pytest.mark.parametrize(
    "case", ["single_user", "system_multi_turn", "consecutive_users", "reasoning_history"]
)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_deepseek_v31_is_v3_plus_think_markers(
    deepseek_v3_tokenizer_dir: Path, case: str, generation_prompt: bool
) -> None:
    """Without tools and with thinking off, V3.1 is V3 with `</think>` after each
    `<｜Assistant｜>` (and answers before a `</think>` in history cut, which V3 keeps)."""
    official = _from_npm(deepseek_v3_tokenizer_dir)
    messages, _ = CASES[case]
    if case == "reasoning_history":
        messages = messages[:3]
    options = RenderOptions(add_generation_prompt=generation_prompt, enable_thinking=False)
    v3 = official.renderer().render(messages, (), options)
    v31 = _builtin("deepseek-v3.1", official).render(messages, (), options)
    assert v31.replace("<｜Assistant｜></think>", "<｜Assistant｜>") == v3
    assert v31.count("</think>") == v3.count("<｜Assistant｜>")


# --- golden renderings of the families without a template here ---------------------------------
# Rendered with each family's published template (see the module docstrings), then frozen.

CITY = Tool(
    "get_weather",
    "Weather for a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"}},
        "required": ["city"],
    },
)
AGENT_TURN = (
    Message("system", "Be brief."),
    Message("user", "Weather in Paris and Rome?"),
    Message(
        "assistant",
        "Checking.",
        reasoning="Two cities: two calls.",
        tool_calls=(
            ToolCall("c1", "get_weather", '{"city": "Paris"}'),
            ToolCall("c2", "get_weather", '{"city": "Rome"}'),
        ),
    ),
    Message("tool", "sunny", tool_call_id="c1"),
    Message("tool", "rain", tool_call_id="c2"),
)
# Llama 3.1 takes one call per assistant turn.
LLAMA_AGENT_TURN = (
    *AGENT_TURN[:2],
    Message("assistant", "Checking.", tool_calls=AGENT_TURN[2].tool_calls[:1]),
    AGENT_TURN[3],
)
CHAT = (
    Message("user", "2+2?"),
    Message("assistant", "4", reasoning="Add."),
    Message("user", "3+3?"),
)
_BOS = {"deepseek-v3.1": "<｜begin▁of▁sentence｜>", "llama3": "<|begin_of_text|>"}

GOLDEN = {
    "qwen3-coder": (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You have access to the following functions:\n\n<tools>\n<function>\n"
        "<name>get_weather</name>\n<description>Weather for a city.</description>\n"
        "<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n"
        '<description>City name</description>\n</parameter>\n<required>["city"]</required>\n'
        "</parameters>\n</function>\n</tools>\n\n"
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n"
        "\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
        "value_1\n</parameter>\n<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\nthat can span\nmultiple lines\n"
        "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
        "- Function calls MUST follow the specified format: an inner "
        "<function=...></function> block must be nested within "
        "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural "
        "language BEFORE the function call, but NOT after\n"
        "- If there is no function call available, answer the question like normal "
        "with your current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT><|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n"
    ),
    # qwen3-coder chat, thinking off
    "qwen3-coder/chat": (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    ),
    "qwen3.5": (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": '
        '"Weather for a city.", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string", "description": "City name"}}, "required": '
        '["city"]}}}\n</tools>\n\n'
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n"
        "\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
        "value_1\n</parameter>\n<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\nthat can span\nmultiple lines\n"
        "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
        "- Function calls MUST follow the specified format: an inner "
        "<function=...></function> block must be nested within "
        "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural "
        "language BEFORE the function call, but NOT after\n"
        "- If there is no function call available, answer the question like normal "
        "with your current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "Weather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n<think>\n"
        "Two cities: two calls.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    ),
    # qwen3.5 chat, thinking off
    "qwen3.5/chat": (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ),
    "glm-4.7": (
        "[gMASK]<sop><|system|>\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": '
        '"Weather for a city.", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string", "description": "City name"}}, "required": '
        '["city"]}}}\n</tools>\n\n'
        "For each function call, output the function name and arguments within the "
        "following XML format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value"
        "-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_va"
        "lue>...</tool_call><|system|>Be brief.<|user|>Weather in Paris and "
        "Rome?<|assistant|><think>Two cities: two "
        "calls.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_valu"
        "e>Paris</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><"
        "arg_value>Rome</arg_value></tool_call><|observation|><tool_response>sunny</to"
        "ol_response><tool_response>rain</tool_response><|assistant|><think>"
    ),
    # glm-4.7 chat, thinking off
    "glm-4.7/chat": (
        "[gMASK]<sop><|user|>2+2?<|assistant|></think>4<|user|>3+3?<|assistant|></think>"
    ),
    "deepseek-v3.1": (
        "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\nYou have access to the following tools:\n"
        "\n### get_weather\nDescription: Weather for a city.\n\n"
        'Parameters: {"type": "object", "properties": {"city": {"type": "string", '
        '"description": "City name"}}, "required": ["city"]}\n\n'
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_ar"
        "guments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\nWhere:\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
        "Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces\n"
        "<｜User｜>Weather in Paris and "
        "Rome?<｜Assistant｜></think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get"
        '_weather<｜tool▁sep｜>{"city": '
        '"Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": '
        '"Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁output▁be'
        "gin｜>sunny<｜tool▁output▁end｜><｜tool▁output▁begin｜>rain<｜tool▁output▁end｜>"
    ),
    # deepseek-v3.1 chat, thinking off
    "deepseek-v3.1/chat": (
        "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜><｜U"
        "ser｜>3+3?<｜Assistant｜></think>"
    ),
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function "
        "call with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of '
        'argument name and its value}.Do not use variables.\n\n{\n    "type": "function",\n'
        '    "function": {\n        "name": "get_weather",\n'
        '        "description": "Weather for a city.",\n        "parameters": {\n'
        '            "type": "object",\n            "properties": {\n'
        '                "city": {\n                    "type": "string",\n'
        '                    "description": "City name"\n                }\n'
        '            },\n            "required": [\n                "city"\n            ]\n'
        "        }\n    }\n}\n\n"
        "Weather in Paris and Rome?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": '
        '"Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n'
        '"sunny"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    ),
    # llama3 chat, thinking off
    "llama3/chat": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "4<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "3+3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden(name: str) -> None:
    family, _, kind = name.partition("/")
    renderer = builtin_renderer(family, bos_token=_BOS.get(family), eos_token=None)
    if kind == "chat":
        text = renderer.render(CHAT, (), RenderOptions(enable_thinking=False))
    else:
        agent = LLAMA_AGENT_TURN if family == "llama3" else AGENT_TURN
        text = renderer.render(agent, (CITY,), RenderOptions())
    assert text == GOLDEN[name]


# --- thinking switches and chat_template_kwargs ---------------------------------------------------


def _prompt_tail(family: str, options: RenderOptions) -> str:
    renderer = builtin_renderer(family, bos_token=None, eos_token=None)
    return renderer.render([Message("user", "QQ")], (), options).rsplit("QQ", 1)[1]


@pytest.mark.parametrize(
    ("family", "options", "tail"),
    [
        ("qwen3", RenderOptions(), "<|im_end|>\n<|im_start|>assistant\n"),
        ("qwen3", RenderOptions(reasoning_effort="none"), "assistant\n<think>\n\n</think>\n\n"),
        ("qwen3", RenderOptions(reasoning_effort="high"), "<|im_start|>assistant\n"),
        ("qwen3", RenderOptions(enable_thinking=True, reasoning_effort="none"), "assistant\n"),
        ("qwen3.5", RenderOptions(), "<|im_start|>assistant\n<think>\n"),
        ("qwen3.5", RenderOptions(reasoning_effort="minimal"), "<think>\n\n</think>\n\n"),
        ("glm-4.7", RenderOptions(), "<|assistant|><think>"),
        ("glm-4.7", RenderOptions(reasoning_effort="none"), "<|assistant|></think>"),
        ("glm-4.7", RenderOptions(extra={"enable_thinking": False}), "<|assistant|></think>"),
        ("deepseek-v3.1", RenderOptions(), "<｜Assistant｜></think>"),
        ("deepseek-v3.1", RenderOptions(reasoning_effort="high"), "<｜Assistant｜><think>"),
        ("deepseek-v3.1", RenderOptions(enable_thinking=True), "<｜Assistant｜><think>"),
        ("deepseek-v3.1", RenderOptions(extra={"thinking": True}), "<｜Assistant｜><think>"),
        # The template's own `thinking` variable wins over enable_thinking.
        (
            "deepseek-v3.1",
            RenderOptions(enable_thinking=True, extra={"thinking": False}),
            "<｜Assistant｜></think>",
        ),
        ("qwen3-coder", RenderOptions(enable_thinking=True), "<|im_start|>assistant\n"),
    ],
)
def test_thinking_switches(family: str, options: RenderOptions, tail: str) -> None:
    assert _prompt_tail(family, options).endswith(tail)


def test_glm_clear_thinking_false_keeps_old_reasoning() -> None:
    renderer = builtin_renderer("glm-4.7", bos_token=None, eos_token=None)
    kept = renderer.render(CHAT, (), RenderOptions(extra={"clear_thinking": False}))
    dropped = renderer.render(CHAT, (), RenderOptions())
    assert "<|assistant|><think>Add.</think>4" in kept
    assert "<|assistant|></think>4" in dropped


def test_llama3_kwargs() -> None:
    renderer = builtin_renderer("llama3", bos_token="<|begin_of_text|>", eos_token=None)
    options = RenderOptions(extra={"date_string": "01 Jan 2026", "tools_in_user_message": False})
    text = renderer.render([Message("user", "hi")], (CITY,), options)
    assert "Today Date: 01 Jan 2026\n\nYou have access to the following functions." in text
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" + _ASSISTANT)


_ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"


# --- what the formats cannot express is refused ------------------------------------------------------


@pytest.mark.parametrize(
    "family", ["qwen3", "qwen2.5", "qwen3-coder", "glm-4.7", "deepseek-v3.1", "llama3"]
)
def test_text_only_families_refuse_images(family: str) -> None:
    renderer = builtin_renderer(family, bos_token=None, eos_token=None)
    message = Message("user", (TextPart("look"), ImagePart("data:image/png;base64,AAAA")))
    with pytest.raises(TemplateError, match="cannot render images"):
        renderer.render([message], (), RenderOptions())


def test_qwen35_renders_images_but_not_in_system() -> None:
    renderer = builtin_renderer("qwen3.5", bos_token=None, eos_token=None)
    image = (TextPart(" look: "), ImagePart("data:image/png;base64,AAAA"))
    text = renderer.render([Message("user", image)], (), RenderOptions())
    assert text == (
        "<|im_start|>user\nlook: <|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    with pytest.raises(TemplateError, match="System message cannot contain images"):
        renderer.render([Message("system", image), Message("user", "hi")], (), RenderOptions())


@pytest.mark.parametrize("family", ["qwen3-coder", "qwen3.5"])
def test_xml_call_formats_need_object_arguments(family: str) -> None:
    renderer = builtin_renderer(family, bos_token=None, eos_token=None)
    call = Message("assistant", None, tool_calls=(ToolCall("c", "get_time", "[1, 2]"),))
    with pytest.raises(TemplateError, match="JSON object"):
        renderer.render([Message("user", "hi"), call], (CLOCK,), RenderOptions())


def test_llama3_refuses_parallel_calls_as_its_template_does() -> None:
    renderer = builtin_renderer("llama3", bos_token=None, eos_token=None)
    messages = [Message("user", "hi"), Message("assistant", None, tool_calls=CALLS)]
    with pytest.raises(TemplateError, match="only supports single tool-calls"):
        renderer.render(messages, (WEATHER, CLOCK), RenderOptions())


def test_empty_conversation_refused() -> None:
    for family in builtin_families():
        with pytest.raises(TemplateError):
            builtin_renderer(family, bos_token=None, eos_token=None).render([], (), RenderOptions())


# --- choosing a built-in ----------------------------------------------------------------------------


def test_families() -> None:
    assert builtin_families() == {
        "deepseek-v3",
        "deepseek-v3.1",
        "gemma3",
        "glm-4.7",
        "llama3",
        "llama3.0",
        "qwen2.5",
        "qwen3",
        "qwen3-coder",
        "qwen3.5",
    }


def test_unknown_family_names_the_known_ones() -> None:
    with pytest.raises(TemplateError, match=r"'qwen9'.*qwen3-coder"):
        builtin_renderer("qwen9", bos_token=None, eos_token=None)
    with pytest.raises(TemplateError, match="qwen9"):
        renderer_for(None, bos_token=None, eos_token=None, model_type=None, prefer_builtin="qwen9")


def test_prefer_builtin_overrides_the_models_own_template() -> None:
    own = renderer_for("{{ 'own' }}", bos_token=None, eos_token=None, model_type="qwen3")
    assert own.render([Message("user", "x")], (), RenderOptions()) == "own"
    forced = renderer_for(
        "{{ 'own' }}", bos_token=None, eos_token=None, model_type="llama", prefer_builtin="qwen3"
    )
    assert forced.render([Message("user", "x")], (), RenderOptions()) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("model_type", "family"),
    [("qwen3", "qwen3"), ("qwen3_moe", "qwen3"), ("qwen3_5_moe", "qwen3.5"), ("gemma3", "gemma3")],
)
def test_model_type_defaults(model_type: str, family: str) -> None:
    assert model_type in builtin_model_types()
    chosen = renderer_for(None, bos_token="<bos>", eos_token=None, model_type=model_type)
    expected = builtin_renderer(family, bos_token="<bos>", eos_token=None)
    assert type(chosen) is type(expected)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "deepseek_v3", None])
def test_ambiguous_model_types_get_no_default(model_type: str | None) -> None:
    chosen = renderer_for(None, bos_token=None, eos_token=None, model_type=model_type)
    assert isinstance(chosen, MissingTemplateRenderer)
