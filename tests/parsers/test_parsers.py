"""The parser contract, over every parser: chunking never changes the result, the
events obey the OpenAI delta rules, tool names are never invented, and arbitrary
text never makes a parser raise."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import parsers
from parsers._compose import coalesce
from parsers._scan import Machine
from parsers._schema import coerce_text, coerce_value
from parsers.events import Content, Event, Reasoning, ToolCallArgs, ToolCallEnd, ToolCallStart
from tests.support.parser_cases import CASES, DECLARED, TOOLS, Case
from tests.support.parser_tools import W


@dataclass
class Result:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def reconstruct(events: Iterable[Event], declared: frozenset[str] = DECLARED) -> Result:
    """Rebuilds the message as a client would, checking the delta rules on the way."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[tuple[str, list[str]]] = []
    ids: set[str] = set()
    open_call: int | None = None
    after_reasoning = False
    for ev in events:
        if isinstance(ev, Reasoning):
            assert ev.text and open_call is None and not after_reasoning, ev
            reasoning.append(ev.text)
            continue
        after_reasoning = True
        if isinstance(ev, Content):
            assert ev.text and open_call is None, ev
            content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            assert open_call is None and ev.index == len(calls), ev
            assert ev.id and ev.id not in ids and ev.name in declared, ev
            ids.add(ev.id)
            calls.append((ev.name, []))
            open_call = ev.index
        elif isinstance(ev, ToolCallArgs):
            assert ev.fragment and ev.index == open_call, ev
            calls[ev.index][1].append(ev.fragment)
        else:
            assert isinstance(ev, ToolCallEnd) and ev.index == open_call, ev
            open_call = None
    assert open_call is None, "a started call never ended"
    parsed = []
    for name, fragments in calls:
        args = json.loads("".join(fragments))
        assert isinstance(args, dict)
        parsed.append((name, args))
    return Result("".join(reasoning), "".join(content), parsed)


def run(parser: parsers.Parser, pieces: Iterable[str]) -> list[Event]:
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def make(case: Case) -> parsers.Parser:
    return parsers.create(case.parser, tools=case.tools, think=case.think)


@pytest.mark.parametrize("size", [0, 7, 1], ids=["whole", "chunks of 7", "char by char"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}: {c.id}" for c in CASES])
def test_contract(case: Case, size: int) -> None:
    pieces = [case.text] if size == 0 else chunks(case.text, size)
    got = reconstruct(run(make(case), pieces))
    assert got == Result(case.reasoning, case.content, list(case.calls))


def _normal(events: list[Event]) -> list[Event]:
    """Events with neighbouring text pieces merged and ids blanked (ids are random)."""
    return [
        ToolCallStart(e.index, "", e.name) if isinstance(e, ToolCallStart) else e
        for e in coalesce(events)
    ]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}: {c.id}" for c in CASES])
def test_events_do_not_depend_on_chunking(case: Case) -> None:
    """Not only the rebuilt message: the same events in the same order, however the
    text is cut (only where text pieces split differs)."""
    whole = _normal(run(make(case), [case.text]))
    assert _normal(run(make(case), chunks(case.text, 7))) == whole
    assert _normal(run(make(case), chunks(case.text, 1))) == whole


def test_names_and_api() -> None:
    want = {
        "passthrough",
        "think",
        "hermes",
        "qwen3",
        "qwen3-coder",
        "glm-4.7",
        "deepseek-v3.1",
        "llama3-json",
    }
    assert want <= set(parsers.names())
    with pytest.raises(KeyError):
        parsers.create("nope")
    with pytest.raises(ValueError):
        parsers.create("hermes", think="sometimes")  # type: ignore[arg-type]
    assert parsers.think_mode("<|im_start|>assistant\n<think>\n") == "open"
    assert parsers.think_mode("<|im_start|>assistant\n<think>\n\n</think>\n\n") is True


def _args_events(events: Sequence[Event]) -> list[str]:
    return [e.fragment for e in events if isinstance(e, ToolCallArgs)]


def test_hermes_arguments_stream_before_the_call_ends() -> None:
    p = parsers.create("hermes", TOOLS)
    head = '<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": "hello '
    events = p.feed(head)
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgs]
    assert _args_events(events) == ['{"path": "a", "content": "hello ']
    assert _args_events(p.feed("wor")) == ["wor"]
    tail = run(p, ['ld"}}\n</tool_call>'])
    assert tail[:1] == [ToolCallArgs(0, 'ld"}')] and tail[1:] == [ToolCallEnd(0)]


def test_xml_arguments_stream_per_parameter() -> None:
    p = parsers.create("qwen3-coder", TOOLS)
    frags: list[str] = []
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    for piece in chunks(text, 1):
        frags += _args_events(p.feed(piece))
    assert "".join(frags) == '{"city": "Paris", "days": 2'
    assert "".join(_args_events(run(p, ["</function>\n</tool_call>"]))) == "}"

    g = parsers.create("glm-4.7", TOOLS)
    got = _args_events(
        g.feed("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>")
    )
    assert got == ['{"city": "Paris"']
    got = _args_events(g.feed("<arg_key>unit</arg_key><arg_value>c</arg_value>"))
    assert got == [', "unit": "c"']
    assert _args_events(run(g, ["</tool_call>"])) == ["}"]


def test_string_parameters_stream_inside_the_value() -> None:
    p = parsers.create("qwen3-coder", TOOLS)
    head = "<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n<parameter=content>\n"
    assert _args_events(p.feed(head)) == ['{"path": "a.txt", "content": "']
    assert _args_events(p.feed("line one\nline")) == ["line one\\nline"]
    assert _args_events(p.feed(" two\n")) == [" two"]  # the newline waits: padding?
    assert _args_events(p.feed("\n</parameter>\n</function>")) == ['\\n"}']


def test_call_starts_once_required_arguments_begin() -> None:
    """Strictness without giving up streaming: the start waits for the name to be a
    declared tool and for every required argument to have begun."""
    p = parsers.create("hermes", TOOLS)
    assert p.feed('<tool_call>{"name": "write_file", "arguments": {"path": "a"') == []
    events = p.feed(', "content": "x')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgs]


def test_untagged_call_arguments_stream() -> None:
    """A fenced or bare call starts once its name is a declared tool and its required
    arguments are complete and fit (a guess cut off inside one stays text); the
    arguments after them stream as they arrive."""
    p = parsers.create("hermes", TOOLS)
    assert p.feed('Checking.\n```json\n{"name": "get_weather", "arguments": {"city": "Par') == [
        Content("Checking.")
    ]
    events = p.feed('is", "unit": "cel')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgs]
    assert _args_events(events) == ['{"city": "Paris", "unit": "cel']
    assert _args_events(p.feed("si")) == ["si"]
    assert run(p, ['us"}}\n```\nDone.']) == [
        ToolCallArgs(0, 'us"}'),
        ToolCallEnd(0),
        Content("Done."),
    ]


@pytest.mark.parametrize(
    ("text", "more", "shown"),
    [
        ("Hi ```", "py", "Hi"),  # not a call's fence language
        ("```json\n", "print(1)", ""),  # the body is not JSON
        ('x {"name": "get_w', 'x": 1', "x"),  # no declared tool is called that
        ("{", '"city": "Paris"', ""),  # the first key is not a call's
        ('{"type": "function", "name": "get_time", ', '"id": 1', ""),  # nor is this key
        ("[", "1, 2]", ""),  # not a list of objects
    ],
)
def test_held_text_is_released_once_it_cannot_be_a_call(text: str, more: str, shown: str) -> None:
    """What could still become a call is held (only that); the first character that
    rules a call out releases all of it as content, in that same feed."""
    p = parsers.create("hermes", TOOLS)
    first = p.feed(text)
    assert first == ([Content(shown)] if shown else [])
    after = p.feed(more)
    assert all(isinstance(e, Content) for e in after)
    assert shown + "".join(e.text for e in after if isinstance(e, Content)) == text + more


def test_ids_unique_per_parser() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 20
    starts = [
        e for e in run(parsers.create("hermes", TOOLS), [text]) if isinstance(e, ToolCallStart)
    ]
    assert len({s.id for s in starts}) == 20 and [s.index for s in starts] == list(range(20))
    assert all(s.id.startswith("call_") for s in starts)


@pytest.mark.parametrize(
    ("text", "schema", "want"),
    [
        ("5", {"type": "integer"}, 5),
        ("5.0", {"type": "integer"}, 5),
        ("5.5", {"type": "integer"}, "5.5"),
        ("-2.5e1", {"type": "number"}, -25.0),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("null", {"type": "null"}, None),
        ("None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
        ("7", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 7),
        ("007", {"type": "string"}, "007"),
        ("true", {"type": "string"}, "true"),
        ("[1, 2]", {"type": "array", "items": {"type": "string"}}, ["1", "2"]),
        ("{'a': '1'}", {"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": 1}),
        ("nan", {"type": "number"}, "nan"),
        ("x", None, "x"),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),
    ],
)
def test_coerce_text(text: str, schema: dict[str, Any] | None, want: Any) -> None:
    got = coerce_text(text, schema)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    ("value", "schema", "want"),
    [
        ("5", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "5"),
        ("5", {"type": "integer"}, 5),
        (5, {"type": "string"}, "5"),
        (2.0, {"type": "integer"}, 2),
        ([1], {"type": "object"}, [1]),
        ({"n": "1"}, {"type": "object", "properties": {"n": {"type": "number"}}}, {"n": 1}),
        (None, {"type": ["string", "null"]}, None),
    ],
)
def test_coerce_value(value: Any, schema: dict[str, Any], want: Any) -> None:
    got = coerce_value(value, schema)
    assert got == want and type(got) is type(want)


def _long_cases(lines: int) -> list[tuple[str, str]]:
    """Long values and long runs of near misses, `lines` lines of them."""
    body = "x = 1  # <not a tag>\n" * lines
    return [
        (
            "qwen3-coder",
            f"<function=write_file>\n<parameter=path>\na\n</parameter>\n<parameter=content>\n{body}\n</parameter>\n</function>",
        ),
        (
            "hermes",
            '<tool_call>{"name": "write_file", "arguments": {"path": "a", "content": '
            + json.dumps(body)
            + "}}</tool_call>",
        ),
        (
            "glm-4.7",
            f"<tool_call>write_file<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>content</arg_key><arg_value>{body}</arg_value></tool_call>",
        ),
        ("think", f"<think>{body}</think>{body}"),
        (
            "hermes",
            'Now:\n```json\n{"name": "write_file", "arguments": {"path": "a", "content": '
            + json.dumps(body)
            + "}}\n```",
        ),
        ("hermes", "{x} [y] `{` ```\n{\n```\n" * lines),  # near misses, one after another
        ("hermes", "```python\n" + body + "```"),
    ]


@dataclass
class Work:
    """What a parser did, counted rather than timed: Python function calls made, and
    characters the marker scanner looked at (the held tail plus the new text)."""

    calls: int = 0
    scanned: int = 0


def _measure(name: str, text: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Work, Result]:
    """Feeds `text` char by char, counting the work."""
    work = Work()
    scan = Machine._run

    def counting_run(self: Machine, text: str, final: bool = False) -> None:
        work.scanned += len(self._held) + len(text)
        scan(self, text, final)

    def count_calls(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            work.calls += 1

    with monkeypatch.context() as patch:
        patch.setattr(Machine, "_run", counting_run)
        parser = parsers.create(name, TOOLS)
        sys.setprofile(count_calls)
        try:
            events = run(parser, chunks(text, 1))
        finally:
            sys.setprofile(None)
    return work, reconstruct(events)


def test_long_streams_stay_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Char-by-char feeding of long values does work proportional to the text: twice
    the text, about twice the function calls and scanned characters (quadratic work
    would be four times as much)."""
    lines = 400
    for (name, text), (_, longer) in zip(_long_cases(lines), _long_cases(2 * lines), strict=True):
        small, got = _measure(name, text, monkeypatch)
        large, got_longer = _measure(name, longer, monkeypatch)
        assert large.calls <= 2.2 * small.calls, (name, small, large)
        assert large.scanned <= 2.2 * small.scanned, (name, small, large)
        body = "x = 1  # <not a tag>\n" * lines
        for result, value in ((got, body), (got_longer, body * 2)):
            assert (
                result.calls == [("write_file", {"path": "a", "content": value})]
                or "write_file" not in text
            )


# --- arbitrary text --------------------------------------------------------------

# fmt: off
FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_", "</tool", "\n", " ",
    '{"name": "get_weather", "arguments": {"city": "', '{"name": "nope", "arguments": {',
    '{"name": "get_time", "parameters": {}}', '"}}', "}", "{", '"', "\\", "\\u12", "\\ud83d", ":", ",",
    "<function=get_weather>", "<function=", "</function>", "<parameter=city>", "<parameter=days>",
    "</parameter>", ">", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "get_weather",
    "write_file", "city", "Paris", "3", "true", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<｜tool", "function", "```json",
    "<|python_tag|>", ";", "é", "😀", "\ud800", "```", "```python\n", "```tool_call\n", "[", "]",
    '{"type": "function", "function": ', '{"name": "read_file", "arguments": {"path": "',
    '"arguments": "{\\"path\\": \\"x\\"}"', "\n```\n", '"encoding": 1',
]
# fmt: on
TEXT = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=40).map(
    "".join
)
PARSERS = [n for n in parsers.names() if n != "passthrough"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(PARSERS),
    text=TEXT,
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    think=st.sampled_from([None, False, "open"]),
)
def test_arbitrary_text(name: str, text: str, cuts: list[int], think: Any) -> None:
    whole = reconstruct(run(parsers.create(name, TOOLS, think=think), [text]))
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    split = reconstruct(run(parsers.create(name, TOOLS, think=think), pieces))
    assert split == whole
    single = reconstruct(run(parsers.create(name, TOOLS, think=think), chunks(text, 1)))
    assert single == whole


def _mutate(text: str, mutations: list[tuple[str, int, int, str]]) -> str:
    for op, at, size, fragment in mutations:
        i = at % (len(text) + 1)
        j = min(len(text), i + size)
        if op == "cut":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + fragment + text[i:]
        elif op == "repeat":
            text = text[:j] + text[i:]
        else:
            text = text[:i]
    return text


MUTATION = st.tuples(
    st.sampled_from(["cut", "insert", "repeat", "truncate"]),
    st.integers(min_value=0, max_value=10_000),
    st.integers(min_value=0, max_value=16),
    st.sampled_from(FRAGMENTS),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(CASES),
    mutations=st.lists(MUTATION, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_damaged_cases(
    case: Case, mutations: list[tuple[str, int, int, str]], cuts: list[int]
) -> None:
    """Well-formed cases with tags cut, repeated and inserted: still no exception, no
    invented tool, no broken delta rule, and chunking still changes nothing."""
    text = _mutate(case.text, mutations)
    whole = reconstruct(run(make(case), [text]))
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert reconstruct(run(make(case), pieces)) == whole
    assert reconstruct(run(make(case), chunks(text, 1))) == whole


# a whole call, then the start of a second one, in each format's own markup
_CUT_SHORT = {
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
        '<tool_call>\n{"name": "get_w',
    ),
    "qwen3-coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n",
        "<tool_call>\n<function=get_wea",
    ),
    "glm-4.7": (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call>\n",
        "<tool_call>get_wea",
    ),
    "deepseek-v3.1": (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
        "<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>get_wea",
    ),
    "llama3-json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ',
        '<|python_tag|>{"name": "get_w',
    ),
}


@pytest.mark.parametrize("name", sorted(_CUT_SHORT))
def test_markup_cut_short_at_the_token_limit_is_dropped(name: str) -> None:
    """Output that stops at max_tokens inside a call's markup (a parallel call just
    begun, say) does not show the markup as text: the unfinished call is dropped, at
    every point the cut may fall. A natural end keeps giving a failed call back."""
    whole, second = _CUT_SHORT[name]
    prefix = "" if name == "llama3-json" else "Checking. "
    for cut in range(len(second) + 1):
        text = prefix + whole + second[:cut]
        for size in (0, 1):
            parser = parsers.create(name, tools=TOOLS)
            events = [e for p in (chunks(text, size) if size else [text]) for e in parser.feed(p)]
            got = reconstruct(events + parser.finish(truncated=True))
            assert got == Result(content=prefix.strip(), calls=[W("Paris")]), (cut, got)
    parser = parsers.create(name, tools=TOOLS)
    natural = reconstruct(parser.feed(prefix + whole + second) + parser.finish())
    assert natural.calls == [W("Paris")] and second.strip() in natural.content
