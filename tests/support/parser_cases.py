"""The contract cases every parser is held to: model text -> reasoning, content, calls.

Each case is run fed whole, in chunks of 7 and one character at a time.
"""

from __future__ import annotations

from tests.support.parser_cases_untagged import UNTAGGED
from tests.support.parser_tools import DECLARED, TOOLS, Case, W

__all__ = ["CASES", "DECLARED", "TOOLS", "Case"]

HERMES = [
    Case("plain", "hermes", "Hello, world!\n", content="Hello, world!\n"),
    Case(
        "bare call object opening the reply",
        "hermes",
        ' {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        calls=(W("Paris", days=3),),
    ),
    Case(
        "bare JSON answer stays content",
        "hermes",
        '{"name": "get_weather", "city": "Paris"}',
        content='{"name": "get_weather", "city": "Paris"}',
    ),
    Case(
        "bare call of an undeclared tool stays content",
        "hermes",
        '{"name": "launch", "arguments": {}}',
        content='{"name": "launch", "arguments": {}}',
    ),
    Case(
        "bare call object after text",
        "hermes",
        'Try {"name": "get_weather", "arguments": {"city": "Rome"}}',
        content="Try",
        calls=(W("Rome"),),
    ),
    Case(
        "one call",
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        content="Let me check.",
        calls=(W("Paris"),),
    ),
    Case(
        "two calls, thinking",
        "qwen3",
        "<think>\nNeed two cities.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n</tool_call>',
        reasoning="Need two cities.",
        calls=(W("Paris", days=2), W("Rome", unit="c")),
    ),
    Case(
        "content after calls",
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone.',
        content="Done.",
        calls=(("get_time", {}),),
    ),
    Case(
        "undeclared tool stays content",
        "hermes",
        'Hi <tool_call>\n{"name": "launch", "arguments": {"x": 1}}\n</tool_call>',
        content='Hi <tool_call>\n{"name": "launch", "arguments": {"x": 1}}\n</tool_call>',
    ),
    Case(
        "missing required stays content",
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>',
        content='<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>',
    ),
    Case(
        "coerced from JSON of the wrong type",
        "hermes",
        '<tool_call>{"name": "set_flags", "arguments": {"enabled": "true", "ratio": "0.5", '
        '"tags": "[\\"a\\", \\"b\\"]", "meta": "{\\"n\\": \\"3\\"}", "nothing": "null", '
        '"maybe": "7", "either": "7", "count": 4.0, "label": 12}}</tool_call>',
        calls=(
            (
                "set_flags",
                {
                    "enabled": True,
                    "ratio": 0.5,
                    "tags": ["a", "b"],
                    "meta": {"n": 3},
                    "nothing": None,
                    "maybe": 7,
                    "either": "7",
                    "count": 4,
                    "label": "12",
                },
            ),
        ),
    ),
    Case(
        "arguments double-encoded",
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": \\"1\\"}"}</tool_call>',
        calls=(W("Oslo", days=1),),
    ),
    Case(
        "escapes and unicode",
        "hermes",
        '<tool_call>{"name": "write_file", "arguments": {"path": "a\\\\b.txt", '
        '"content": "l1\\nl2\\t\\"q\\" \\ud83d\\ude00 é \\u00e9 \\/"}}</tool_call>',
        calls=(("write_file", {"path": "a\\b.txt", "content": 'l1\nl2\t"q" 😀 é é /'}),),
    ),
    Case(
        "name after arguments",
        "hermes",
        '<tool_call>{"arguments": {"city": "Lima"}, "name": "get_weather"}</tool_call>',
        calls=(W("Lima"),),
    ),
    Case(
        "two objects in one pair of tags",
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>',
        calls=(("get_time", {}), W("Bern")),
    ),
    Case(
        "malformed JSON stays content",
        "hermes",
        "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
        content="<tool_call>\nget_weather(city=Paris)\n</tool_call>",
    ),
    Case(
        "unclosed call at end of stream",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
        calls=(W("Paris"),),
    ),
    Case(
        "cut off inside a committed call: closed where it stands",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        calls=(W("Par"),),
    ),
    Case(
        "cut off before the name is complete",
        "hermes",
        '<tool_call>\n{"name": "get_wea',
        content='<tool_call>\n{"name": "get_wea',
    ),
    Case(
        "partial marker at the end is content",
        "hermes",
        "Almost a <tool_ca",
        content="Almost a <tool_ca",
    ),
    Case(
        "no tools: markup is content",
        "hermes",
        '<think>r</think>x <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        reasoning="r",
        content='x <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        tools=None,
    ),
    Case(
        "tool opener ends reasoning",
        "qwen3",
        'Thinking about it\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        reasoning="Thinking about it",
        calls=(("get_time", {}),),
        think="open",
    ),
    Case(
        "python literals in arguments",
        "hermes",
        '<tool_call>{"name": "set_flags", "arguments": {"enabled": True, "maybe": None}}</tool_call>',
        calls=(("set_flags", {"enabled": True, "maybe": None}),),
    ),
]

QWEN3_CODER = [
    Case(
        "one call",
        "qwen3-coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        content="I'll check.",
        calls=(W("Paris", days=3),),
    ),
    Case(
        "missing tool_call opener after reasoning",
        "qwen3.5",
        "Plan.\n</think>\n\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        reasoning="Plan.",
        calls=(W("Paris"),),
        think="open",
    ),
    Case(
        "function opener ends reasoning",
        "qwen3.5",
        "Plan.\n<function=get_time>\n</function>",
        reasoning="Plan.",
        calls=(("get_time", {}),),
        think="open",
    ),
    Case(
        "mismatched and missing closers",
        "qwen3-coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</tool_call>",
        calls=(W("Paris", days=3), W("Rome")),
    ),
    Case(
        "function closes a function",
        "qwen3-coder",
        "<function=get_time>\n<function=get_weather>\n<parameter=city>Oslo</parameter></function>",
        calls=(("get_time", {}), W("Oslo")),
    ),
    Case(
        "multi-line string kept exactly",
        "qwen3-coder",
        "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\n"
        "def f(x):\n    return x < 3 and x > 1\n\n</parameter>\n</function>\n</tool_call>",
        calls=(
            (
                "write_file",
                {"path": "/tmp/a.py", "content": "def f(x):\n    return x < 3 and x > 1\n"},
            ),
        ),
    ),
    Case(
        "coercion from text",
        "qwen3-coder",
        "<tool_call>\n<function=set_flags>\n"
        "<parameter=enabled>\nTrue\n</parameter>\n<parameter=ratio>\n2.5\n</parameter>\n"
        '<parameter=tags>\n["x", "y"]\n</parameter>\n<parameter=meta>\n{"n": "4"}\n</parameter>\n'
        "<parameter=nothing>\nnull\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n"
        "<parameter=either>\n12\n</parameter>\n<parameter=count>\n5\n</parameter>\n"
        "<parameter=label>\n007\n</parameter>\n<parameter=extra>\n1\n</parameter>\n"
        "</function>\n</tool_call>",
        calls=(
            (
                "set_flags",
                {
                    "enabled": True,
                    "ratio": 2.5,
                    "tags": ["x", "y"],
                    "meta": {"n": 4},
                    "nothing": None,
                    "maybe": None,
                    "either": 12,
                    "count": 5,
                    "label": "007",
                    "extra": "1",
                },
            ),
        ),
    ),
    Case(
        "undeclared function stays content",
        "qwen3-coder",
        "<tool_call>\n<function=rm_rf>\n<parameter=p>\n/\n</parameter>\n</function>\n</tool_call>",
        content="<tool_call>\n<function=rm_rf>\n<parameter=p>\n/\n</parameter>\n</function>\n</tool_call>",
    ),
    Case(
        "missing required stays content",
        "qwen3-coder",
        "<function=write_file>\n<parameter=path>\nx\n</parameter>\n</function>",
        content="<function=write_file>\n<parameter=path>\nx\n</parameter>\n</function>",
    ),
    Case(
        "cut off inside a string value",
        "qwen3-coder",
        "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n<parameter=content>\nhello\nwor",
        calls=(("write_file", {"path": "a", "content": "hello\nwor"}),),
    ),
    Case(
        "prose inside tool_call tags is content",
        "qwen3-coder",
        "<tool_call>\nnot a call</tool_call>",
        content="<tool_call>\nnot a call</tool_call>",
    ),
]

GLM_REPAIR = {  # seed 003, TestRepairGLM46XML: the call's inner text -> arguments
    "already valid": ("func<arg_key>k</arg_key><arg_value>v</arg_value>", {"k": "v"}),
    "missing </arg_value> at end": ("func<arg_key>k</arg_key><arg_value>v", {"k": "v"}),
    "missing </arg_value> before next arg_key": (
        "func<arg_key>a</arg_key><arg_value>1<arg_key>b</arg_key><arg_value>2</arg_value>",
        {"a": "1", "b": "2"},
    ),
    "missing <arg_value> open tag": ("func<arg_key>k</arg_key>v</arg_value>", {"k": "v"}),
    "missing </arg_key> close tag": ("func<arg_key>k<arg_value>v</arg_value>", {"k": "v"}),
    "missing <arg_key> open tag": ("func k</arg_key><arg_value>v</arg_value>", {"k": "v"}),
    "all closing tags missing": ("func<arg_key>k<arg_value>v", {"k": "v"}),
    "all opening tags missing": ("func k</arg_key>v</arg_value>", {"k": "v"}),
    "multiple pairs with mixed missing tags": (
        "func<arg_key>a</arg_key>1</arg_value><arg_key>b<arg_value>2</arg_value>",
        {"a": "1", "b": "2"},
    ),
    "newlines preserved": (
        "func\n<arg_key>city</arg_key>\nNew York</arg_value>",
        {"city": "New York"},
    ),
}

GLM = [
    *(
        Case(
            f"seed: {name}{end[1]}",
            "glm-4.7",
            f"<tool_call>{inner}{end[0]}",
            calls=(("func", args),),
        )
        for name, (inner, args) in GLM_REPAIR.items()
        for end in (("</tool_call>", ""), ("", ", cut off"))
    ),
    Case(
        "seed: no tags at all",
        "glm-4.7",
        "<tool_call>just plain text</tool_call>",
        content="<tool_call>just plain text</tool_call>",
    ),
    Case(
        "seed: unopened arg_value after arg_key",
        "glm-4.7",
        "<tool_call>get-weather\n<arg_key>city</arg_key>\nNew York</arg_value>\n<arg_key>unit</arg_key>\ncelsius</arg_value></tool_call>",
        calls=(("get-weather", {"city": "New York", "unit": "celsius"}),),
    ),
    Case(
        "seed: mixed unopened and valid arg_values",
        "glm-4.7",
        "<tool_call>get-weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\ncelsius</arg_value></tool_call>",
        calls=(("get-weather", {"city": "Paris", "unit": "celsius"}),),
    ),
    Case(
        "well-formed 4.7 with reasoning",
        "glm-4.7",
        "<think>Weather needed.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        reasoning="Weather needed.",
        content="Checking.",
        calls=(W("Paris", days=2),),
    ),
    Case(
        "4.5 layout, two calls, the second opener closes the first",
        "glm-4.5",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
        "<tool_call>get_time\n</tool_call>",
        calls=(W("Oslo"), ("get_time", {})),
    ),
    Case(
        "value with no tags at the end (ours)",
        "glm-4.7",
        "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>",
        calls=(W("Paris"),),
    ),
    Case(
        "key with no value (ours)",
        "glm-4.7",
        "<tool_call>func<arg_key>k</tool_call>",
        calls=(("func", {"k": ""}),),
    ),
    Case(
        "value text kept exactly between real tags (ours)",
        "glm-4.7",
        "<tool_call>write_file<arg_key>path</arg_key><arg_value> a.txt</arg_value>"
        "<arg_key>content</arg_key><arg_value>line1\n  line2\n</arg_value></tool_call>",
        calls=(("write_file", {"path": " a.txt", "content": "line1\n  line2\n"}),),
    ),
    Case(
        "typed values (ours)",
        "glm-4.7",
        "<tool_call>set_flags<arg_key>tags</arg_key><arg_value>['a', 'b']</arg_value>"
        '<arg_key>meta</arg_key><arg_value>{"n": 1}</arg_value><arg_key>enabled</arg_key>'
        "<arg_value>false</arg_value><arg_key>ratio</arg_key><arg_value>3</arg_value></tool_call>",
        calls=(
            ("set_flags", {"tags": ["a", "b"], "meta": {"n": 1}, "enabled": False, "ratio": 3}),
        ),
    ),
    Case(
        "older name-then-JSON form (ours)",
        "glm-4.7",
        '<tool_call>get_weather\n{"city": "Kyiv", "days": "2"}\n</tool_call>',
        calls=(W("Kyiv", days=2),),
    ),
    Case(
        "undeclared tool stays content",
        "glm-4.7",
        "<tool_call>get_stock<arg_key>s</arg_key><arg_value>X</arg_value></tool_call>",
        content="<tool_call>get_stock<arg_key>s</arg_key><arg_value>X</arg_value></tool_call>",
    ),
    Case(
        "missing required stays content",
        "glm-4.7",
        "<tool_call>get_weather<arg_key>days</arg_key><arg_value>1</arg_value></tool_call>",
        content="<tool_call>get_weather<arg_key>days</arg_key><arg_value>1</arg_value></tool_call>",
    ),
]

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK = [
    Case(
        "v3.1 thinking, content, two calls",
        "deepseek-v3.1",
        f"Let me look.</think>Looking.{B}{CB}get_weather{SEP}"
        '{"city": "Paris", "days": "2"}'
        f"{CE}{CB}get_time{SEP}{{}}{CE}{E}",
        reasoning="Let me look.",
        content="Looking.",
        calls=(W("Paris", days=2), ("get_time", {})),
        think="open",
    ),
    Case(
        "v3 form with a json fence",
        "deepseek-v3",
        f'{B}{CB}function{SEP}get_weather\n```json\n{{"city": "Oslo"}}\n```{CE}{E}',
        calls=(W("Oslo"),),
    ),
    Case(
        "call without the calls-begin marker",
        "deepseek-v3.1",
        f'{CB}get_weather{SEP}{{"city": "Rome"}}{CE}',
        calls=(W("Rome"),),
    ),
    Case(
        "undeclared tool stays content",
        "deepseek-v3.1",
        f"{B}{CB}nope{SEP}{{}}{CE}{E}",
        content=f"{B}{CB}nope{SEP}{{}}{CE}{E}",
    ),
    Case(
        "tool marker ends reasoning",
        "deepseek-v3.1",
        f"thinking{B}{CB}get_time{SEP}{{}}{CE}{E}",
        reasoning="thinking",
        calls=(("get_time", {}),),
        think="open",
    ),
]

LLAMA = [
    Case(
        "whole message is the call",
        "llama3-json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": "3"}}',
        calls=(W("Paris", days=3),),
    ),
    Case(
        "python tag, two calls",
        "llama3-json",
        '<|python_tag|>{"type": "function", "name": "get_weather", "parameters": {"city": "A"}}; '
        '{"name": "get_time", "parameters": {}}',
        calls=(W("A"), ("get_time", {})),
    ),
    Case(
        "a JSON answer is content",
        "llama3-json",
        ' {"name": "Ada", "age": 36}',
        content=' {"name": "Ada", "age": 36}',
    ),
    Case(
        "a call later in the message, bare",
        "llama3-json",
        'Here: {"name": "get_time", "parameters": {}}',
        content="Here:",
        calls=(("get_time", {}),),
    ),
    Case(
        "a call later in the message, fenced",
        "llama3-json",
        'Calling it.\n```json\n{"name": "get_weather", "parameters": {"city": "Quito"}}\n```\n',
        content="Calling it.",
        calls=(W("Quito"),),
    ),
    Case(
        "JSON later in the message that is not a call is content",
        "llama3-json",
        'Here: {"name": "get_time", "when": "now"}',
        content='Here: {"name": "get_time", "when": "now"}',
    ),
    Case(
        "a JSON answer is content to its end",
        "llama3-json",
        '{"name": "Ada", "pets": [{"name": "get_time", "parameters": {}}]}',
        content='{"name": "Ada", "pets": [{"name": "get_time", "parameters": {}}]}',
    ),
    Case(
        "text after a tag-less call goes on as content",
        "llama3-json",
        '{"name": "get_time", "parameters": {}} and more',
        content="and more",
        calls=(("get_time", {}),),
    ),
    Case(
        "python tag with code is content",
        "llama3-json",
        "<|python_tag|>print(1)",
        content="<|python_tag|>print(1)",
    ),
]

THINK = [
    Case(
        "reasoning then content",
        "think",
        "<think>\nA.\n\nB.\n</think>\n\nAnswer.",
        reasoning="A.\n\nB.",
        content="Answer.",
    ),
    Case(
        "no think tag", "think", "Just text <think>x</think>", content="Just text <think>x</think>"
    ),
    Case(
        "open: starts in reasoning",
        "think",
        "Hmm.\n</think>\nYes.",
        reasoning="Hmm.",
        content="Yes.",
        think="open",
    ),
    Case(
        "open: a repeated open tag is dropped",
        "think",
        "\n<think>Hmm.</think>Yes.",
        reasoning="Hmm.",
        content="Yes.",
        think="open",
    ),
    Case(
        "off: tags are content",
        "think",
        "<think>x</think>y",
        content="<think>x</think>y",
        think=False,
    ),
    Case("padding before the tag", "think", "\n\n<think>r</think>c", reasoning="r", content="c"),
    Case("never closed: all reasoning", "think", "<think>still going", reasoning="still going"),
    Case("empty reasoning", "qwen3", "<think>\n\n</think>\n\nHi", content="Hi"),
    Case(
        "open: no tool opener without tools",
        "qwen3",
        "a<tool_call>b",
        reasoning="a<tool_call>b",
        think="open",
        tools=None,
    ),
    Case(
        "passthrough",
        "passthrough",
        "<think>x</think><tool_call>",
        content="<think>x</think><tool_call>",
    ),
]

CASES: list[Case] = [*HERMES, *UNTAGGED, *QWEN3_CODER, *GLM, *DEEPSEEK, *LLAMA, *THINK]
