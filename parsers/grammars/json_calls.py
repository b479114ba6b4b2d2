"""Call grammars of the formats whose arguments are one JSON object, laid out as the
templates write them back (json.dumps' separators):

hermes (Qwen2.5, Qwen3; parsers/hermes.py), several calls one block per line:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

llama3-json (parsers/llama3_json.py, templates/llama3.py): the whole message is the
call, several separated by "; ":

    {"name": "get_weather", "parameters": {"city": "Paris"}}

deepseek-v3.1 (parsers/deepseek_v31.py, templates/deepseek.py), calls chained with no
separator inside one block (deepseek-v3: `function<｜tool▁sep｜>NAME`, then the arguments
in a ```json fence, calls a line apart):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Argument schemas compile leniently: keywords the engine does not implement are left
unenforced rather than refusing the client's tools. A string argument with a custom
grammar (GRAMMAR_KEY) keeps to it where the grammar is regular (a JSON string's
content can follow a regex, not a context-free grammar): see lark_regex.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from parsers.grammars._common import (
    GRAMMAR_KEY,
    CallGrammar,
    Schema,
    Tag,
    ToolDef,
    containing,
    lazy_start,
    lit,
    tool_defs,
)
from parsers.grammars.lark_regex import GrammarTooLarge, lark_to_regex
from runtime.text import json_schema_rule

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_MARKERS = (DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP)
V3_FENCE, V3_FENCE_END, V3_GAP = "\n```json\n", "\n```", "\n"  # DeepSeek-V3's layout


def json_arguments(params: Schema) -> str:
    """`%json` for a tool's arguments; a string argument with a custom grammar gets
    the grammar as its pattern when it is regular, else stays any string."""
    props = params.get("properties")
    if isinstance(props, Mapping) and any(_custom(s) for s in props.values()):
        params = {**params, "properties": {k: _plain(k, v) for k, v in props.items()}}
    return json_schema_rule(params, lenient=True)


def _arguments_rule(tool: ToolDef) -> str:
    """json_arguments of a tool; a grammar too large to flatten names the tool."""
    try:
        return json_arguments(tool.params)
    except GrammarTooLarge as exc:
        raise GrammarTooLarge(f"tool {tool.name!r}, {exc}") from None


def _custom(schema: Any) -> Mapping[str, Any] | None:
    found = schema.get(GRAMMAR_KEY) if isinstance(schema, Mapping) else None
    return found if isinstance(found, Mapping) else None


def _plain(name: str, schema: Any) -> Any:
    custom = _custom(schema)
    if custom is None:
        return schema
    out = {k: v for k, v in schema.items() if k != GRAMMAR_KEY}
    definition = str(custom.get("definition", ""))
    try:
        regex = definition if custom.get("syntax") == "regex" else lark_to_regex(definition)
    except GrammarTooLarge as exc:
        raise GrammarTooLarge(f"argument {name!r}: {exc}") from None
    if regex is not None:
        out["pattern"] = f"^(?:{regex})$"
    return out


def _tails(tools: list[ToolDef], key: str) -> tuple[list[str], dict[str, str]]:
    """Per tool, the rest of its call object after `{"name": "`: rules, and the tail
    rule by tool name."""
    rules: list[str] = []
    tails: dict[str, str] = {}
    for tool in tools:
        lead = lit(json.dumps(tool.name, ensure_ascii=False)[1:-1] + f'", "{key}": ')
        rules.append(f"tail_{tool.key}: {lead} args_{tool.key} {lit('}')}")
        rules.append(f"args_{tool.key}: {_arguments_rule(tool)}")
        tails[tool.name] = f"tail_{tool.key}"
    return rules, tails


def _object_grammar(
    rules: str, opener: str, tails: dict[str, str], key: str, after: str, lazy: str
) -> CallGrammar:
    """The CallGrammar of a one-object format: a forced call's opener stops at `{"name":
    "` with several tools; with one it names the tool and stops after `"KEY":`, where
    the model's own tokens break (`":` then ` {"`). `after` follows the call object."""
    if len(tails) > 1:
        return CallGrammar(rules, opener, f"start: tail{after}\n{rules}", lazy)
    ((name, rule),) = tails.items()
    args = rule.replace("tail_", "args_")
    named = opener + json.dumps(name, ensure_ascii=False)[1:-1] + f'", "{key}":'
    return CallGrammar(rules, named, f"start: {lit(' ')} {args} {lit('}')}{after}\n{rules}", lazy)


def hermes(
    tools: Sequence[Mapping[str, Any]], *, tag: Tag, parallel: bool, only: Sequence[str] | None
) -> CallGrammar | None:
    defs = tool_defs(tools, only)
    if not defs:
        return None
    tail_rules, tails = _tails(defs, "arguments")
    newline, opener = lit("\n"), HERMES_OPEN + '\n{"name": "'
    more = f" ({newline} call)*" if parallel else ""
    rules = "\n".join([
        f"calls: call{more}",
        # the closing tag may be left out: a model that ends after the object is
        # not made to go on (the parser closes the call at the end)
        f"call: {tag(HERMES_OPEN)} head tail close?",
        "call_rest: head tail close",
        f"head: {lit(opener[len(HERMES_OPEN):])}",
        f"tail: {' | '.join(tails.values())}",
        f"close: {newline} {tag(HERMES_CLOSE)}",
        *tail_rules,
        "",
    ])  # fmt: skip
    lazy = lazy_start([(HERMES_OPEN, "call_rest")], tag=tag, parallel=parallel) + rules
    return _object_grammar(rules, opener, tails, "arguments", f" close?{more}", lazy)


def llama3_json(
    tools: Sequence[Mapping[str, Any]], *, tag: Tag, parallel: bool, only: Sequence[str] | None
) -> CallGrammar | None:
    """The message is the calls; with tool_choice auto it is either calls (opening
    with `{"name"`, or with the python tag) or text that does not open that way."""
    defs = tool_defs(tools, only)
    if not defs:
        return None
    tail_rules, tails = _tails(defs, "parameters")
    opener = '{"name": "'
    more = f" ({lit('; ')} call)*" if parallel else ""
    rules = "\n".join([
        f"calls: call{more}",
        f"call: {lit(opener)} tail",
        f"tail: {' | '.join(tails.values())}",
        *tail_rules,
        "",
    ])  # fmt: skip
    python_tag = tag(PYTHON_TAG)
    plain = r"/(?s:.+)/ & ~/\s*\{\s*\"name\"(?s:.*)/" + f" & ~{containing([PYTHON_TAG])}"
    lazy = "\n".join([
        f"start: calls | {python_tag} calls | PLAIN?",
        f"PLAIN: {plain}",
        rules,
    ])  # fmt: skip
    return _object_grammar(rules, opener, tails, "parameters", more, lazy)


def deepseek(
    tools: Sequence[Mapping[str, Any]],
    *,
    tag: Tag,
    parallel: bool,
    only: Sequence[str] | None,
    v3: bool = False,
) -> CallGrammar | None:
    """DeepSeek-V3.1's calls; `v3` for DeepSeek-V3's layout (its official template):
    `function<｜tool▁sep｜>NAME` and the arguments in a ```json fence, calls a line
    apart."""
    defs = [
        t for t in tool_defs(tools, only)
        if t.name and t.name == t.name.strip() and len(t.name) <= 256
        and not any(m in t.name for m in DS_MARKERS)
        and not (v3 and ("\n" in t.name or t.name == "function"))
    ]  # fmt: skip
    if not defs:
        return None
    sep, end, blocks_end = tag(DS_SEP), tag(DS_CALL_END), tag(DS_CALLS_END)
    bodies = {t.name: f"body_{t.key}" for t in defs}
    lines = []
    for t in defs:
        if v3:
            head = f"{lit('function')} {sep} {lit(t.name + V3_FENCE)}"
            lines.append(f"body_{t.key}: {head} args_{t.key} {lit(V3_FENCE_END)}")
        else:
            lines.append(f"body_{t.key}: {lit(t.name)} {sep} args_{t.key}")
        lines.append(f"args_{t.key}: {_arguments_rule(t)}")
    gap = f"{lit(V3_GAP)} " if v3 else ""
    repeat = f" ({gap}one)*" if parallel else ""
    rules = "\n".join([
        f"calls: {tag(DS_CALLS)} block_rest",
        f"block_rest: one{repeat} {blocks_end}",
        f"one: {tag(DS_CALL)} one_rest",
        f"one_rest: body {end}",
        f"body: {' | '.join(bodies.values())}",
        *lines,
        "",
    ])  # fmt: skip
    lazy = lazy_start([(DS_CALLS, "block_rest"), (DS_CALL, "one_rest")], tag=tag, parallel=parallel)
    opener = DS_CALLS + DS_CALL
    if len(bodies) > 1:
        after = f"start: one_rest{repeat} {blocks_end}\n{rules}"
        return CallGrammar(rules, opener, after, lazy + rules)
    # one tool: the opener names it, up to its arguments
    ((name, body),) = bodies.items()
    args, fence = body.replace("body_", "args_"), f"{lit(V3_FENCE_END)} " if v3 else ""
    after = f"start: {args} {fence}{end}{repeat} {blocks_end}\n{rules}"
    named = f"function{DS_SEP}{name}{V3_FENCE}" if v3 else name + DS_SEP
    return CallGrammar(rules, opener + named, after, lazy + rules)
