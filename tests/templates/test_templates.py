"""Chat template rendering, checked against transformers' `apply_chat_template` as the oracle.

Real templates: the official ones shipped with the qwen3 / gemma3 / llama3.1 / deepseek-v3
tokenizers and the ones inside the SmolLM2 and Qwen2.5-Coder GGUFs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from templates import (
    Gemma3Renderer,
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
    renderer_for,
)
from templates.hf import JsonArguments
from tests.support.gguf_metadata import gguf_metadata

# Real files come from the fixtures in tests/support/fixtures_real.py (via conftest).


# --- template sources -----------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    name: str
    template: str
    bos_token: str | None
    eos_token: str | None
    # DeepSeek's template concatenates arguments as text; the rest take a dict.
    arguments_as_text: bool = False


def _token(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _from_tokenizer_dir(name: str, folder: Path) -> Source:
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    return Source(
        name,
        config["chat_template"],
        _token(config.get("bos_token")),
        _token(config.get("eos_token")),
        arguments_as_text=name == "deepseek_v3",
    )


def _from_gguf(name: str, path: Path) -> Source:
    meta = gguf_metadata(path)
    tokens = meta["tokenizer.ggml.tokens"]
    return Source(
        name,
        meta["tokenizer.chat_template"],
        tokens[meta["tokenizer.ggml.bos_token_id"]],
        tokens[meta["tokenizer.ggml.eos_token_id"]],
    )


# Read each GGUF once per session.
@pytest.fixture(scope="session")
def smollm2_source(smollm2_gguf: Path) -> Source:
    return _from_gguf("smollm2", smollm2_gguf)


@pytest.fixture(scope="session")
def qwen25_source(qwen25_gguf: Path) -> Source:
    return _from_gguf("qwen2.5-coder", qwen25_gguf)


_SOURCE_FIXTURES = {
    "qwen3": "qwen3_tokenizer_dir",
    "gemma3": "gemma3_tokenizer_dir",
    "llama3_1": "llama3_tokenizer_dir",
    "deepseek_v3": "deepseek_v3_tokenizer_dir",
    "smollm2": "smollm2_source",
    "qwen2.5-coder": "qwen25_source",
}


@pytest.fixture(scope="module", params=sorted(_SOURCE_FIXTURES))
def source(request: pytest.FixtureRequest) -> Source:
    name: str = request.param
    value = request.getfixturevalue(_SOURCE_FIXTURES[name])
    return value if isinstance(value, Source) else _from_tokenizer_dir(name, value)


@pytest.fixture(scope="module")
def gemma3_source(gemma3_tokenizer_dir: Path) -> Source:
    return _from_tokenizer_dir("gemma3", gemma3_tokenizer_dir)


# --- the oracle -----------------------------------------------------------------------------


def _oracle_tokenizer(src: Source) -> Any:
    """A transformers tokenizer carrying only the template and special tokens: rendering
    with tokenize=False needs no vocabulary."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    fast: Any = PreTrainedTokenizerFast  # untyped in transformers
    tokenizer = fast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        bos_token=src.bos_token,
        eos_token=src.eos_token,
    )
    tokenizer.chat_template = src.template
    return tokenizer


def _openai_message(m: Message, *, arguments_as_text: bool, null_as: Any) -> dict[str, Any]:
    """The OpenAI-style dict a transformers user would write for `m`."""
    content: Any = m.content
    if content is None:
        content = null_as
    elif isinstance(content, tuple):
        if all(isinstance(p, TextPart) for p in content):
            content = "".join(p.text for p in content if isinstance(p, TextPart))
        else:
            content = [
                {"type": "text", "text": p.text}
                if isinstance(p, TextPart)
                else {"type": "image", "image": p.source}
                for p in content
            ]
    d: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": c.arguments if arguments_as_text else json.loads(c.arguments),
                },
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning is not None:
        d["reasoning_content"] = m.reasoning
    return d


def _openai_tools(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        function: dict[str, Any] = {"name": t.name}
        if t.description is not None:  # an OpenAI client leaves an absent description out
            function["description"] = t.description
        function["parameters"] = json.loads(json.dumps(dict(t.parameters)))
        out.append({"type": "function", "function": function})
    return out


def _oracle_kwargs(options: RenderOptions) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(options.extra)
    if options.enable_thinking is not None:
        kwargs["enable_thinking"] = options.enable_thinking
    if options.reasoning_effort is not None:
        kwargs["reasoning_effort"] = options.reasoning_effort
    return kwargs


def oracle(
    src: Source,
    messages: Sequence[Message],
    tools: Sequence[Tool],
    options: RenderOptions,
    *,
    null_as: Any = None,
) -> str | Exception:
    """transformers' rendering, or the exception it raised."""
    tokenizer = _oracle_tokenizer(src)
    dicts = [
        _openai_message(m, arguments_as_text=src.arguments_as_text, null_as=null_as)
        for m in messages
    ]
    try:
        rendered = tokenizer.apply_chat_template(
            dicts,
            tools=_openai_tools(tools),
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            **_oracle_kwargs(options),
        )
    except Exception as exc:  # the template's own failure is part of what we compare
        return exc
    assert isinstance(rendered, str)
    return rendered


def ours(
    src: Source, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
) -> str | TemplateError:
    renderer = renderer_for(
        src.template, bos_token=src.bos_token, eos_token=src.eos_token, model_type=None
    )
    try:
        return renderer.render(messages, tools, options)
    except TemplateError as exc:
        return exc


def assert_same(expected: str | Exception, actual: str | TemplateError, label: str) -> None:
    if isinstance(expected, Exception):
        assert isinstance(actual, TemplateError), f"{label}: oracle raised {expected!r}"
        if type(expected) is jinja2.TemplateError:  # raise_exception: same words for the client
            assert str(actual) == str(expected), label
        return
    assert not isinstance(actual, TemplateError), f"{label}: we raised {actual}"
    assert actual == expected, label


# --- the corpus -----------------------------------------------------------------------------

WEATHER = Tool(
    "get_weather",
    "Current weather for a city. Returns <json> & 'quotes'.",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["city"],
    },
)
CLOCK = Tool("get_time", None, {"type": "object", "properties": {}})

CALLS = (
    ToolCall("call_1", "get_weather", '{"city": "Zürich", "unit": "c"}'),
    ToolCall("call_2", "get_time", "{}"),
)

CORPUS: dict[str, tuple[tuple[Message, ...], tuple[Tool, ...]]] = {
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
    "text_parts": (
        (Message("user", (TextPart("Hello, "), TextPart("world <b>&</b>"))),),
        (),
    ),
    "unicode": ((Message("user", "Grüße 🌍 — «ok» <tag>"),), ()),
    "tools": (
        (
            Message("system", "Use tools."),
            Message("user", "Weather in Zürich and the time?"),
            Message("assistant", "", tool_calls=CALLS),
            Message("tool", '{"temp": 21}', tool_call_id="call_1", name="get_weather"),
            Message("tool", "12:00", tool_call_id="call_2", name="get_time"),
            Message("assistant", "It is 21 °C at noon."),
            Message("user", "Thanks"),
        ),
        (WEATHER, CLOCK),
    ),
    "tools_pending_result": (
        (
            Message("user", "Weather?"),
            Message("assistant", "Let me check.", tool_calls=CALLS[:1]),
            Message("tool", "sunny", tool_call_id="call_1", name="get_weather"),
        ),
        (WEATHER,),
    ),
    "reasoning": (
        (
            Message("user", "Think about 2+2."),
            Message("assistant", "4", reasoning="2 plus 2 is 4."),
            Message("user", "And 3+3?"),
            Message("assistant", "6", reasoning="3 plus 3 is 6."),
        ),
        (),
    ),
}

OPTIONS = (
    RenderOptions(),
    RenderOptions(add_generation_prompt=False),
    RenderOptions(enable_thinking=False),
    RenderOptions(enable_thinking=True, extra={"custom_flag": True}),
)


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_matches_transformers(source: Source, case: str) -> None:
    messages, tools = CORPUS[case]
    for options in OPTIONS:
        label = f"{source.name}/{case}/{options}"
        assert_same(
            oracle(source, messages, tools, options), ours(source, messages, tools, options), label
        )


def test_null_content_beside_tool_calls(source: Source) -> None:
    """`content: null` is tried as a missing key (transformers), then None, then ""."""
    messages = (
        Message("user", "Weather?"),
        Message("assistant", None, tool_calls=CALLS),
        Message("tool", "sunny", tool_call_id="call_1"),
    )
    options = RenderOptions()
    # transformers drops None-valued keys itself, so the first two are both "missing".
    expected = oracle(source, messages, (WEATHER,), options)
    if isinstance(expected, Exception):
        expected = _render_with_none(source, messages, (WEATHER,), options)
    if isinstance(expected, Exception):
        expected = oracle(source, messages, (WEATHER,), options, null_as="")
    assert_same(expected, ours(source, messages, (WEATHER,), options), source.name)


def _render_with_none(
    src: Source, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
) -> str | Exception:
    """transformers' renderer below apply_chat_template, which keeps None values."""
    from transformers.utils import chat_template_utils

    render_jinja_template: Any = chat_template_utils.render_jinja_template

    dicts = [
        _openai_message(m, arguments_as_text=src.arguments_as_text, null_as=None) for m in messages
    ]
    specials = {k: v for k, v in (("bos_token", src.bos_token), ("eos_token", src.eos_token)) if v}
    try:
        rendered, _ = render_jinja_template(
            conversations=[dicts],
            tools=_openai_tools(tools),
            chat_template=src.template,
            add_generation_prompt=options.add_generation_prompt,
            **specials,
        )
    except Exception as exc:
        return exc
    return str(rendered[0])


def test_deepseek_renders_tool_calls_with_null_content(deepseek_v3_tokenizer_dir: Path) -> None:
    src = _from_tokenizer_dir("deepseek_v3", deepseek_v3_tokenizer_dir)
    messages = (Message("user", "Weather?"), Message("assistant", None, tool_calls=CALLS[:1]))
    text = ours(src, messages, (WEATHER,), RenderOptions(add_generation_prompt=False))
    assert isinstance(text, str)
    assert '<｜tool▁sep｜>get_weather\n```json\n{"city": "Zürich", "unit": "c"}\n```' in text


# --- built-in Gemma 3 -------------------------------------------------------------------------

GEMMA_CASES: dict[str, tuple[Message, ...]] = {
    "single_user": (Message("user", "Hello!"),),
    "system_multi_turn": CORPUS["system_multi_turn"][0],
    "whitespace": (
        Message("system", "  keep my spaces  "),
        Message("user", "\n\t padded \n"),
        Message("assistant", "  answer\n\n"),
        Message("user", (TextPart("  a "), TextPart(" b  "))),
    ),
    "images": (
        Message(
            "user", (TextPart(" look: "), ImagePart("data:image/png;base64,AAAA"), TextPart(" ok "))
        ),
    ),
    "system_parts": (
        Message("system", (TextPart("sys "), ImagePart("http://x/y.png"))),
        Message("user", "hi"),
    ),
    "system_only": (Message("system", "alone"),),
    "null_content": (
        Message("system", None),
        Message("user", "q"),
        Message("assistant", None, tool_calls=CALLS[:1]),
        Message("user", "more"),
    ),
    "tool_at_model_position": (
        Message("user", "q"),
        Message("tool", "result", tool_call_id="call_1"),
    ),
    "consecutive_users": CORPUS["consecutive_users"][0],
    "starts_with_assistant": (Message("assistant", "hi"),),
    "system_image_first": (
        Message("system", (ImagePart("http://x/y.png"), TextPart("sys"))),
        Message("user", "hi"),
    ),
}


def _gemma_builtin(src: Source) -> Renderer:
    renderer = renderer_for(
        None, bos_token=src.bos_token, eos_token=src.eos_token, model_type="gemma3"
    )
    assert isinstance(renderer, Gemma3Renderer)
    return renderer


def _try(render: Callable[[], str]) -> str | TemplateError:
    try:
        return render()
    except TemplateError as exc:
        return exc


@pytest.mark.parametrize("case", sorted(GEMMA_CASES))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_gemma3_builtin_matches_official(
    gemma3_source: Source, case: str, generation_prompt: bool
) -> None:
    messages = GEMMA_CASES[case]
    options = RenderOptions(add_generation_prompt=generation_prompt)
    official = HFTemplateRenderer(
        gemma3_source.template, bos_token=gemma3_source.bos_token, eos_token=gemma3_source.eos_token
    )
    expected = _try(lambda: official.render(messages, (WEATHER,), options))
    actual = _try(lambda: _gemma_builtin(gemma3_source).render(messages, (WEATHER,), options))
    if isinstance(expected, TemplateError):
        assert isinstance(actual, TemplateError), case
    else:
        assert actual == expected, case
    if not any(m.content is None for m in messages):
        assert_same(oracle(gemma3_source, messages, (), options), actual, case)


_texts = st.text(alphabet=st.sampled_from("ab \n\t<>é"), max_size=8)


@st.composite
def _gemma_conversations(draw: st.DrawFn) -> tuple[Message, ...]:
    turns = draw(st.integers(1, 5))
    out: list[Message] = []
    if draw(st.booleans()):
        out.append(Message("system", draw(_texts)))
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        if draw(st.booleans()):
            content: str | tuple[TextPart | ImagePart, ...] = draw(_texts)
        else:
            parts = st.one_of(_texts.map(TextPart), st.just(ImagePart("img")))
            content = tuple(draw(st.lists(parts, max_size=3)))
        out.append(Message(role, content))
    return tuple(out)


@settings(max_examples=60, deadline=None)
@given(messages=_gemma_conversations(), generation_prompt=st.booleans())
def test_gemma3_builtin_property(
    gemma3_source: Source, messages: tuple[Message, ...], generation_prompt: bool
) -> None:
    options = RenderOptions(add_generation_prompt=generation_prompt)
    official = HFTemplateRenderer(
        gemma3_source.template, bos_token=gemma3_source.bos_token, eos_token=gemma3_source.eos_token
    )
    expected = _try(lambda: official.render(messages, (), options))
    actual = _try(lambda: _gemma_builtin(gemma3_source).render(messages, (), options))
    if isinstance(expected, TemplateError):
        assert isinstance(actual, TemplateError)
    else:
        assert actual == expected


# --- choosing a renderer ----------------------------------------------------------------------


def test_own_template_wins_over_builtin() -> None:
    r = renderer_for("{{ 'own' }}", bos_token="<bos>", eos_token=None, model_type="gemma3")
    assert isinstance(r, HFTemplateRenderer)
    assert r.render([Message("user", "x")], (), RenderOptions()) == "own"


def test_builtin_for_gemma3_text() -> None:
    r = renderer_for(None, bos_token="<bos>", eos_token=None, model_type="gemma3_text")
    text = r.render([Message("user", "hi")], (), RenderOptions())
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize("template", [None, "", "  \n"])
def test_missing_template(template: str | None) -> None:
    r = renderer_for(template, bos_token=None, eos_token=None, model_type="llama")
    assert isinstance(r, MissingTemplateRenderer)
    with pytest.raises(TemplateError, match=r"no chat template.*/v1/completions"):
        r.render([Message("user", "hi")], (), RenderOptions())


# --- the environment ------------------------------------------------------------------------


def _render(template: str, messages: Sequence[Message] = (), **kw: Any) -> str:
    r = renderer_for(template, bos_token="<s>", eos_token="</s>", model_type=None)
    return r.render(messages or [Message("user", "hi")], (), RenderOptions(**kw))


def test_raise_exception_keeps_its_message() -> None:
    with pytest.raises(TemplateError) as info:
        _render("{{ raise_exception('Only user roles, got ' + messages[0].role) }}")
    assert str(info.value) == "Only user roles, got user"


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].content.no.such }}",  # undefined attribute of undefined
        "{{ 1 + messages[0].content }}",  # TypeError
        "{{ ''.__class__.__mro__ }}",  # sandbox
        "{% set ns = namespace(_x=1) %}",  # underscore namespace names
        "{{ messages.append(1) }}",  # immutable sandbox
        "{{ 1 / 0 }}",
    ],
)
def test_template_failures_become_template_errors(template: str) -> None:
    with pytest.raises(TemplateError):
        _render(template)


def test_syntax_error_at_construction() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        renderer_for("{% for %}", bos_token=None, eos_token=None, model_type=None)


def test_tojson_does_not_escape_html_and_takes_options() -> None:
    out = _render(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(ensure_ascii=True) }}"
        "|{{ x | tojson(separators=(',', ':'), sort_keys=True) }}",
        extra={"x": {"b": "<é>&'", "a": [1]}},
    )
    parts = out.split("|")
    assert parts[0] == '{"b": "<é>&\'", "a": [1]}'
    assert parts[1] == '{\n  "b": "<é>&\'",\n  "a": [\n    1\n  ]\n}'
    assert parts[2] == '{"b": "<\\u00e9>&\'", "a": [1]}'
    assert parts[3] == '{"a":[1],"b":"<é>&\'"}'


def test_globals_and_extensions() -> None:
    out = _render(
        "{{ strftime_now('%Y') | length }}|{{ dict(a=1).a }}"
        "|{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "|{% generation %}body{% endgeneration %}|{{ bos_token }}{{ eos_token }}"
    )
    assert out == "4|1|1|body|<s></s>"


def test_trim_and_lstrip_blocks() -> None:
    assert _render("  {% if true %}\nx\n  {% endif %}\n") == "x\n"


def test_unset_options_are_undefined() -> None:
    t = "{{ enable_thinking is defined }} {{ reasoning_effort is defined }} {{ add_generation_prompt }}"
    assert _render(t) == "False False True"
    assert _render(t, enable_thinking=False, reasoning_effort="low") == "True True True"


def test_missing_special_tokens_render_empty() -> None:
    r = renderer_for("[{{ bos_token }}]", bos_token=None, eos_token=None, model_type=None)
    assert r.render([Message("user", "x")], (), RenderOptions()) == "[]"


def test_explicit_options_override_extra() -> None:
    out = _render("{{ enable_thinking }}", enable_thinking=True, extra={"enable_thinking": False})
    assert out == "True"
    assert _render("{{ enable_thinking }}", extra={"enable_thinking": False}) == "False"


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_reserved_extra_keys_rejected(key: str) -> None:
    with pytest.raises(TemplateError, match=key):
        _render("x", extra={key: 1})


def test_empty_conversation_rejected() -> None:
    r = renderer_for("x", bos_token=None, eos_token=None, model_type=None)
    with pytest.raises(TemplateError):
        r.render([], (), RenderOptions())


# --- the message dicts templates see --------------------------------------------------------


def test_tool_call_arguments_read_as_dict_and_as_text() -> None:
    text = '{"city":  "Zürich"}'  # odd spacing survives where the template prints the text
    messages = [Message("assistant", "", tool_calls=(ToolCall("c", "f", text),))]
    t = (
        "{% set a = messages[0].tool_calls[0].function.arguments %}"
        "{{ a is mapping }}|{{ a.city }}|{{ a | tojson }}|{{ a }}|{{ '>' + a + '<' }}"
        "|{% for k, v in a.items() %}{{ k }}={{ v }}{% endfor %}"
    )
    assert _render(t, messages) == f'True|Zürich|{{"city": "Zürich"}}|{text}|>{text}<|city=Zürich'


def test_arguments_that_are_not_an_object_stay_text() -> None:
    messages = [Message("assistant", "", tool_calls=(ToolCall("c", "f", "not json"),))]
    t = "{{ messages[0].tool_calls[0].function.arguments is string }}"
    assert _render(t, messages) == "True"
    assert isinstance(JsonArguments({"a": 1}, '{"a":1}'), dict)


def test_message_shape() -> None:
    messages = [
        Message("assistant", "x", tool_calls=(ToolCall("c1", "lookup", "{}"),), reasoning="r"),
        Message("tool", "res", tool_call_id="c1"),
        Message("user", (TextPart("a"), ImagePart("img://1"))),
    ]
    t = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    lines = _render(t, messages).splitlines()
    first = json.loads(lines[0])
    assert first["reasoning_content"] == first["thinking"] == "r"
    assert first["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {}}}
    ]
    # A tool result gets the function name from the call it answers.
    assert json.loads(lines[1]) == {
        "role": "tool",
        "content": "res",
        "name": "lookup",
        "tool_call_id": "c1",
    }
    assert json.loads(lines[2])["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image", "image": "img://1"},
    ]


def test_tools_shape() -> None:
    t = "{{ tools | tojson }}|{{ tools is none }}"
    r = renderer_for(t, bos_token=None, eos_token=None, model_type=None)
    out = r.render([Message("user", "x")], (CLOCK, WEATHER), RenderOptions())
    tools_json, _ = out.split("|")
    assert json.loads(tools_json)[0] == {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    }
    assert r.render([Message("user", "x")], (), RenderOptions()).endswith("|True")


def test_values_are_immutable() -> None:
    options = RenderOptions()
    with pytest.raises(TypeError):
        options.extra["x"] = 1  # type: ignore[index]
    assert replace(options, enable_thinking=True).enable_thinking is True


def test_tool_call_arguments_cannot_be_mutated() -> None:
    messages = [Message("assistant", "", tool_calls=(ToolCall("c", "f", '{"a": 1}'),))]
    with pytest.raises(TemplateError, match="unsafe"):
        _render("{{ messages[0].tool_calls[0].function.arguments.update({'b': 2}) }}", messages)
