"""The grammar of each tool-call format, for constrained decoding: the call syntax with
each declared tool's name and its argument schema, as Lark text in llguidance's dialect
(runtime/constraints.py compiles it).

Formats with a grammar: hermes (Qwen2.5, Qwen3):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are several such blocks, one per line. The arguments are laid out as the
model's chat template writes them back (json.dumps' separators). Markers the vocabulary
holds as single tokens are written as those tokens (`tag`), so the model writes them as
it was trained to, not spelled out in pieces.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.constraints import json_schema_rule

Tag = Callable[[str], str]  # a marker -> a grammar item (its special token, or its text)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_NAMES = frozenset({"hermes", "qwen2.5", "qwen3"})


@dataclass(frozen=True)
class CallGrammar:
    """`rules` define `calls`: one or more complete calls (or exactly one, without
    parallel calls). `opener` is the text a forced call's prompt ends with, and
    `after_opener` the whole grammar of what follows it: the rest of that call, then
    the further calls `calls` allows."""

    rules: str
    opener: str
    after_opener: str


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _function(tool: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    fn = tool.get("function", tool)
    params = fn.get("parameters")
    return str(fn["name"]), params if isinstance(params, Mapping) and params else {"type": "object"}


def hermes(
    tools: Sequence[Mapping[str, Any]],
    *,
    tag: Tag,
    parallel: bool = True,
    only: Sequence[str] | None = None,
) -> CallGrammar:
    """Hermes calls to the declared `tools` (OpenAI-shaped), or to those named in
    `only`. Argument schemas compile leniently: keywords the engine does not implement
    are left unenforced rather than refusing the client's tools."""
    rules: list[str] = []
    tails: dict[str, str] = {}  # name -> the rule for the rest of its call object
    for i, tool in enumerate(tools):
        name, params = _function(tool)
        if only is not None and name not in only:
            continue
        # the rest of the call object after `{"name": "`, up to its closing brace
        lead = _lit(json.dumps(name, ensure_ascii=False)[1:-1] + '", "arguments": ')
        rules.append(f"tail_{i}: {lead} args_{i} {_lit('}')}")
        rules.append(f"args_{i}: {json_schema_rule(params, lenient=True)}")
        tails[name] = f"tail_{i}"
    if not tails:
        raise ValueError("a tool-call grammar needs at least one tool")
    newline, opener = _lit("\n"), HERMES_OPEN + '\n{"name": "'
    head = _lit(opener[len(HERMES_OPEN) :])
    more = f" ({newline} call)*" if parallel else ""
    rules_text = "\n".join(
        [
            f"calls: call{more}",
            # the closing tag may be left out: a model that ends after the object is
            # not made to go on (the parser closes the call at the end)
            f"call: {tag(HERMES_OPEN)} {head} tail close?",
            f"tail: {' | '.join(tails.values())}",
            f"close: {newline} {tag(HERMES_CLOSE)}",
            *rules,
            "",
        ]
    )
    if len(tails) > 1:
        return CallGrammar(rules_text, opener, f"start: tail close?{more}\n{rules_text}")
    # one tool: the opener names it, so the call is known from the first token on; it
    # stops after the colon, where the model's own tokens break (`":` then ` {"`)
    ((name, rule),) = tails.items()
    named = opener + json.dumps(name, ensure_ascii=False)[1:-1] + '", "arguments":'
    args = rule.replace("tail_", "args_")
    first = f"start: {_lit(' ')} {args} {_lit('}')} close?{more}\n"
    return CallGrammar(rules_text, named, first + rules_text)


def call_grammar(
    parser: str,
    tools: Sequence[Mapping[str, Any]],
    *,
    tag: Tag,
    parallel: bool = True,
    only: Sequence[str] | None = None,
) -> CallGrammar | None:
    """The call grammar of the format `parser` reads (parsers.create's names), or None
    when that format has none yet."""
    if parser in _HERMES_NAMES and tools:
        return hermes(tools, tag=tag, parallel=parallel, only=only)
    return None


def free_calls(parser: str, *, tag: Tag) -> str | None:
    """Rules for `calls` in a format without a grammar: its call opener, then any
    tokens. Next to a response format's grammar this keeps tool calls possible (their
    syntax then unchecked) instead of ruling them out. None for a format with no
    tool calls."""
    from parsers import _formats  # the registry of formats, by parser name

    factory = _formats().get(parser)
    openers: tuple[str, ...] = getattr(factory, "openers", ())
    return f"calls: {tag(openers[0])} <[*]>*\n" if openers else None
