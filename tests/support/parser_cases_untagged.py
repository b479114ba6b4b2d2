"""Contract cases for tool calls written without the format's tags, as small models
write them (Qwen2.5-Coder-0.5B, run against real agent clients, wrote every call in a
```json fence, often after a sentence): bare JSON anywhere, or in a fence, is a call
only when it names a declared tool and its arguments check out; otherwise the text
comes back exactly as written.
"""

from __future__ import annotations

from tests.support.parser_tools import Case, W

F = "```"
UNTAGGED = [
    Case(
        "fenced after a sentence",
        "hermes",
        f'Let\'s proceed.\n\n{F}json\n{{"name": "read_file", "arguments": {{"path": "hello.txt"}}}}\n{F}\n',
        content="Let's proceed.",
        calls=(("read_file", {"path": "hello.txt"}),),
    ),
    Case(
        "Qwen2.5-Coder-0.5B's own output (captured at temperature 0)",
        "qwen2.5",
        f'{F}json\n{{\n  "name": "read_file",\n  "arguments": {{\n    "path": "hello.txt"\n  }}\n}}\n{F}',
        calls=(("read_file", {"path": "hello.txt"}),),
    ),
    Case(
        "Qwen2.5-Coder-0.5B: a sentence, then the fence (captured at temperature 0)",
        "qwen2.5",
        'To read the file "hello.txt" and provide a response, I\'ll use the `read_file` '
        "function from the provided XML. Here's the JSON response:\n\n"
        f'{F}json\n{{\n  "name": "read_file",\n  "arguments": {{\n    "path": "hello.txt"\n  }}\n}}\n{F}',
        content='To read the file "hello.txt" and provide a response, I\'ll use the '
        "`read_file` function from the provided XML. Here's the JSON response:",
        calls=(("read_file", {"path": "hello.txt"}),),
    ),
    Case(
        "tool_call fence",
        "hermes",
        f'I will check.\n{F}tool_call\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n{F}',
        content="I will check.",
        calls=(W("Oslo"),),
    ),
    Case(
        "tool_code fence, plain fence",
        "hermes",
        f'{F}tool_code\n{{"name": "get_time", "arguments": {{}}}}\n{F}\n'
        f'{F}\n{{"name": "get_weather", "arguments": {{"city": "Lima"}}}}\n{F}',
        calls=(("get_time", {}), W("Lima")),
    ),
    Case(
        "bare object mid-reply, text after it",
        "hermes",
        'Sure, checking.\n{"name": "get_weather", "arguments": {"city": "Rome"}}\nOne moment.',
        content="Sure, checking.One moment.",
        calls=(W("Rome"),),
    ),
    Case(
        "text after a fenced call",
        "hermes",
        f'{F}json\n{{"name": "get_time", "arguments": {{}}}}\n{F}\n\nI will wait for the result.',
        content="I will wait for the result.",
        calls=(("get_time", {}),),
    ),
    Case(
        "list of two calls in a fence",
        "hermes",
        f'{F}json\n[\n  {{"name": "get_weather", "arguments": {{"city": "Paris"}}}},\n'
        f'  {{"name": "get_time", "arguments": {{}}}}\n]\n{F}',
        calls=(W("Paris"), ("get_time", {})),
    ),
    Case(
        "bare list of two calls",
        "hermes",
        'Both: [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Bern"}}]',
        content="Both:",
        calls=(("get_time", {}), W("Bern")),
    ),
    Case(
        "unknown tool stays text verbatim",
        "hermes",
        f'Let me try.\n{F}json\n{{"name": "launch_rocket", "arguments": {{"when": "now"}}}}\n{F}\n',
        content=f'Let me try.\n{F}json\n{{"name": "launch_rocket", "arguments": {{"when": "now"}}}}\n{F}\n',
    ),
    Case(
        "a declared name's prefix is not a call",
        "hermes",
        '{"name": "get", "arguments": {}}',
        content='{"name": "get", "arguments": {}}',
    ),
    Case(
        "schema mismatch stays text verbatim",
        "hermes",
        f'{F}json\n{{"name": "sleep", "arguments": {{"seconds": "a while"}}}}\n{F}',
        content=f'{F}json\n{{"name": "sleep", "arguments": {{"seconds": "a while"}}}}\n{F}',
    ),
    Case(
        "wrong type before the required argument stays text",
        "hermes",
        'x {"name": "get_weather", "arguments": {"days": "soon", "city": "Paris"}}',
        content='x {"name": "get_weather", "arguments": {"days": "soon", "city": "Paris"}}',
    ),
    Case(
        "an object for a string stays text",
        "hermes",
        '{"name": "read_file", "arguments": {"path": {"dir": "a"}}}',
        content='{"name": "read_file", "arguments": {"path": {"dir": "a"}}}',
    ),
    Case(
        "missing required argument stays text",
        "hermes",
        'Ok: {"name": "write_file", "arguments": {"path": "a.txt"}}',
        content='Ok: {"name": "write_file", "arguments": {"path": "a.txt"}}',
    ),
    Case(
        "coerced to the schema",
        "hermes",
        'Waiting.\n{"name": "sleep", "arguments": {"seconds": "5"}}',
        content="Waiting.",
        calls=(("sleep", {"seconds": 5}),),
    ),
    Case(
        "a wrong optional argument after the call started is left out",
        "hermes",
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": "soon", "unit": "c"}}',
        calls=(W("Paris", unit="c"),),
    ),
    Case(
        "extra arguments dropped when the schema is closed",
        "hermes",
        f'{F}json\n{{"name": "read_file", "arguments": {{"path": "a.txt", "encoding": "utf-8"}}}}\n{F}',
        calls=(("read_file", {"path": "a.txt"}),),
    ),
    Case(
        "extra arguments kept when the schema is open",
        "hermes",
        f'{F}json\n{{"name": "get_weather", "arguments": {{"city": "Paris", "country": "FR"}}}}\n{F}',
        calls=(W("Paris", country="FR"),),
    ),
    Case(
        "arguments as a JSON string",
        "hermes",
        f'{F}json\n{{"name": "read_file", "arguments": "{{\\"path\\": \\"b.txt\\", \\"mode\\": 1}}"}}\n{F}',
        calls=(("read_file", {"path": "b.txt"}),),
    ),
    Case(
        "arguments as a string that does not fit stay text",
        "hermes",
        '{"name": "sleep", "arguments": "{\\"seconds\\": [1]}"}',
        content='{"name": "sleep", "arguments": "{\\"seconds\\": [1]}"}',
    ),
    Case(
        "function shapes",
        "hermes",
        '{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}\n'
        '{"type": "function", "name": "get_time", "parameters": {}}',
        calls=(W("Lima"), ("get_time", {})),
    ),
    Case(
        "a type other than function stays text",
        "hermes",
        '{"type": "object", "name": "get_time", "arguments": {}}',
        content='{"type": "object", "name": "get_time", "arguments": {}}',
    ),
    Case(
        "arguments before the name stay text",
        "hermes",
        'See {"arguments": {"city": "Rome"}, "name": "get_weather"}',
        content='See {"arguments": {"city": "Rome"}, "name": "get_weather"}',
    ),
    Case(
        "a name without arguments stays text",
        "hermes",
        '{"name": "get_time"}',
        content='{"name": "get_time"}',
    ),
    Case(
        "a non-JSON fence stays text, calls inside it too",
        "hermes",
        f'Run this:\n{F}python\nprint({{"name": "get_time", "arguments": {{}}}})\n{F}\nDone.',
        content=f'Run this:\n{F}python\nprint({{"name": "get_time", "arguments": {{}}}})\n{F}\nDone.',
    ),
    Case(
        "a JSON fence that is not a call stays text",
        "hermes",
        f'{F}json\n{{"name": "Ada", "age": 36}}\n{F}\n',
        content=f'{F}json\n{{"name": "Ada", "age": 36}}\n{F}\n',
    ),
    Case(
        "a call inside other JSON stays text",
        "hermes",
        '{"results": [{"name": "get_time", "arguments": {}}]}',
        content='{"results": [{"name": "get_time", "arguments": {}}]}',
    ),
    Case(
        "braces and brackets in prose",
        "hermes",
        "See [the docs](x), use {braces} and `{}` freely: [1, 2] {",
        content="See [the docs](x), use {braces} and `{}` freely: [1, 2] {",
    ),
    Case(
        "two fences, only the second is a call",
        "hermes",
        f'{F}json\n{{"status": "ok"}}\n{F}\nNow the call:\n{F}json\n{{"name": "get_time", "arguments": {{}}}}\n{F}',
        content=f'{F}json\n{{"status": "ok"}}\n{F}\nNow the call:',
        calls=(("get_time", {}),),
    ),
    Case(
        "unclosed fence, complete object: a call",
        "hermes",
        f'Here:\n{F}json\n{{"name": "get_weather", "arguments": {{"city": "Kyiv"}}}}',
        content="Here:",
        calls=(W("Kyiv"),),
    ),
    Case(
        "unclosed fence, object cut before it checks out: text",
        "hermes",
        f'Here:\n{F}json\n{{"name": "get_weather", "arguments": {{"days": 2',
        content=f'Here:\n{F}json\n{{"name": "get_weather", "arguments": {{"days": 2',
    ),
    Case(
        "cut off inside a required argument: text",
        "hermes",
        f'{F}json\n{{"name": "read_file", "arguments": {{"path": "hel',
        content=f'{F}json\n{{"name": "read_file", "arguments": {{"path": "hel',
    ),
    Case(
        "cut off in an optional argument after the call started: closed where it stands",
        "hermes",
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "cel',
        calls=(W("Oslo", unit="cel"),),
    ),
    Case(
        "Qwen2.5-Coder-0.5B repeating its call until max_tokens (captured)",
        "qwen2.5",
        '{"name": "read_file", "arguments": {"path": "hello.txt"}}\n'
        '{"name": "read_file", "arguments": {"path": "hello.txt"}}\n'
        '{"name": "read_file", "arguments": {"path": "',
        content='{"name": "read_file", "arguments": {"path": "',
        calls=(("read_file", {"path": "hello.txt"}),) * 2,
    ),
    Case(
        "unclosed fence, no object yet: text",
        "hermes",
        f"Here:\n{F}json\n",
        content=f"Here:\n{F}json\n",
    ),
    Case(
        "a tagged call is still read after a fence",
        "hermes",
        f'{F}bash\nls\n{F}\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>',
        content=f"{F}bash\nls\n{F}",
        calls=(("get_time", {}),),
    ),
    Case(
        "no tools: fenced JSON is content",
        "hermes",
        f'{F}json\n{{"name": "get_time", "arguments": {{}}}}\n{F}',
        content=f'{F}json\n{{"name": "get_time", "arguments": {{}}}}\n{F}',
        tools=None,
    ),
    Case(
        "think-only parser: fenced JSON is content",
        "think",
        f'{F}json\n{{"name": "get_time", "arguments": {{}}}}\n{F}',
        content=f'{F}json\n{{"name": "get_time", "arguments": {{}}}}\n{F}',
    ),
    Case(
        "passthrough: bare JSON is content",
        "passthrough",
        'Ok {"name": "get_time", "arguments": {}}',
        content='Ok {"name": "get_time", "arguments": {}}',
    ),
    Case(
        "fenced JSON inside reasoning stays reasoning",
        "qwen3",
        f'<think>\nMaybe {F}json\n{{"name": "get_time", "arguments": {{}}}}\n{F}\n</think>\n\nNo call.',
        reasoning=f'Maybe {F}json\n{{"name": "get_time", "arguments": {{}}}}\n{F}',
        content="No call.",
    ),
]
