"""Call grammars of the XML-like formats, each written as its template writes calls:
qwen3-coder / qwen3.5 (the layout is in parsers/qwen3_coder.py's docstring; template
templates/qwen3_coder.py) and glm-4.7 (parsers/glm47.py, templates/glm47.py), which
has no separators anywhere; glm-4.5 and 4.6 put a newline after the name and after each
closing tag:

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>

Arguments come in the schema's property order, required ones always; values follow
parsers/grammars/_values.py. A tool whose name or required argument names the format
cannot carry (or whose required argument no value can satisfy) is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from parsers.grammars._common import (
    CallGrammar,
    Schema,
    Tag,
    ToolDef,
    is_token,
    lazy_start,
    lit,
    members,
    tool_defs,
)
from parsers.grammars._values import value_form
from runtime.text import json_schema_rule

QC_TOOL, QC_TOOL_END = "<tool_call>", "</tool_call>"
QC_FN, QC_FN_END = "<function=", "</function>"
QC_PARAM, QC_PARAM_END = "<parameter=", "</parameter>"
QC_MARKERS = (QC_TOOL, QC_TOOL_END, QC_FN, QC_FN_END, QC_PARAM, QC_PARAM_END)
GLM_TOOL, GLM_TOOL_END = "<tool_call>", "</tool_call>"
GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = (
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
GLM_MARKERS = (GLM_TOOL, GLM_TOOL_END, GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END)
NL = "\n"
Item = Callable[[str, str], str]  # (argument name, value rule) -> the argument's Lark text


@dataclass
class _Builder:
    """Collects the rules of one grammar: per tool, its arguments; per argument, its
    value up to the marker that closes it (`lead` text, then `closer`)."""

    tag: Tag
    markers: tuple[str, ...]
    closer: str
    lead: str
    lines: list[str] = field(default_factory=list)
    parts: list[tuple[str, str]] = field(default_factory=list)
    count: int = 0

    def value(self, schema: Schema, root: Schema) -> str | None:
        """A rule for a value and its closing marker; None if no value can do."""
        form = value_form(schema, root, self.markers)
        if form is None:
            return None
        self.count += 1
        rule, closer = f"v{self.count}", self.tag(self.closer)
        lead = f"{lit(self.lead)} " if self.lead else ""
        if form.raw is not None:
            term = f"RAW{self.count}"
            self.lines.append(f"{term}: {form.raw}")
            if not is_token(closer):
                # lazy: the text runs to the closer's first occurrence
                self.lines.append(f"{rule}[lazy]: {term} {lit(self.lead + self.closer)}")
            elif self.lead:
                self.lines.append(f"{rule}: {term}_LED {closer}")
                self.lines.append(f"{term}_LED: {term} {lit(self.lead)}")
            else:
                self.lines.append(f"{rule}: {term}? {closer}")
        elif form.json is not None:
            args = json_schema_rule(form.json, lenient=True)
            self.lines.append(f"{rule}: {args} {lead}{closer}")
        else:
            assert form.grammar is not None
            name = f"tool_input_{self.count}"
            self.parts.append((name, custom_lark(*form.grammar)))
            self.lines.append(f"{rule}: @{name} {lead}{closer}")
        return rule


def custom_lark(syntax: str, definition: str) -> str:
    """A custom tool's grammar as a Lark grammar of its own."""
    if syntax == "regex":
        return "start: /" + definition.replace("/", "\\/") + "/\n"
    return definition if definition.endswith("\n") else definition + "\n"


def _arguments(
    build: _Builder, tool: ToolDef, item: Item, bad_key: Callable[[str], bool]
) -> list[str] | None:
    """The argument items of one tool's call (each a rule, optional ones with `?`), or
    None when the tool cannot be called in this format (a required argument whose name
    the format cannot carry, or that no value read back can satisfy)."""
    args = members(tool.params)
    if args is None:
        return None
    out = []
    for key, schema, required in args:
        rule = None if bad_key(key) else build.value(schema, tool.params)
        if rule is None:
            if required:
                return None
            continue
        build.count += 1
        build.lines.append(f"a{build.count}: {item(key, rule)}")
        out.append(f"a{build.count}" + ("" if required else "?"))
    return out


def _functions(
    build: _Builder,
    tools: Sequence[ToolDef],
    name_ok: Callable[[str], bool],
    item: Item,
    bad_key: Callable[[str], bool],
    body: Callable[[str, str], str],
) -> dict[str, tuple[str, str]]:
    """One rule per callable tool, `body(name, argument items)`: name -> (the rule, its
    argument items). Tools whose name the format cannot carry are left out."""
    out: dict[str, tuple[str, str]] = {}
    for tool in tools:
        if not tool.name or not name_ok(tool.name):
            continue
        args = _arguments(build, tool, item, bad_key)
        if args is None:
            continue
        seq = " ".join(args)
        build.lines.append(f"fn_{tool.key}: {body(tool.name, seq)}")
        out[tool.name] = (f"fn_{tool.key}", seq)
    return out


def _rules(
    more: str, opener: str, rest: str, bodies: dict[str, tuple[str, str]], lines: list[str]
) -> str:
    """`calls`: a call is its opener, then the rest of it (`call_rest`, naming `fn`)."""
    return "\n".join([
        f"calls: call{more}",
        f"call: {opener} call_rest",
        f"call_rest: {rest}",
        f"fn: {' | '.join(fn for fn, _ in bodies.values())}",
        *lines,
        "",
    ])  # fmt: skip


def _grammar(
    build: _Builder,
    bodies: dict[str, tuple[str, str]],
    rules: str,
    lazy: str,
    many: tuple[str, str],
    one: Callable[[str, str], tuple[str, str]],
) -> CallGrammar:
    """The CallGrammar: a forced call's (opener, start rule) is `many` with several
    tools, else `one(name, its argument items)`, whose opener names the tool."""
    if len(bodies) > 1:
        opener, start = many
    else:
        ((name, (_, args)),) = bodies.items()
        opener, start = one(name, args)
    return CallGrammar(rules, opener, f"{start}\n{rules}", lazy + rules, tuple(build.parts))


def _has_any(text: str, chars: str) -> bool:
    return any(ch in text for ch in chars)


def _qwen3_coder_argument(key: str, rule: str) -> str:
    return f"{lit(QC_PARAM + key + '>' + NL)} {rule} {lit(NL)}"


def _bad_qwen3_coder_key(key: str) -> bool:
    """A name the parser would not read back whole (it ends at `>`, stops at `<`)."""
    return not key or key != key.strip() or _has_any(key, "<>\n")


def qwen3_coder(
    tools: Sequence[dict[str, Any]], *, tag: Tag, parallel: bool, only: Sequence[str] | None
) -> CallGrammar | None:
    build = _Builder(tag, QC_MARKERS, QC_PARAM_END, "\n")
    bodies = _functions(
        build,
        tool_defs(tools, only),
        lambda name: (
            len(name) <= 256 and not _has_any(name, "<>") and name == "".join(name.split())
        ),
        _qwen3_coder_argument,
        _bad_qwen3_coder_key,
        lambda name, seq: f"{lit(name + '>' + NL)} {seq} {lit(QC_FN_END)}",
    )
    if not bodies:
        return None
    nl, end = lit("\n"), tag(QC_TOOL_END)
    more = f" ({nl} call)*" if parallel else ""
    rules = _rules(more, tag(QC_TOOL), f"{lit(NL + QC_FN)} fn {nl} {end}", bodies, build.lines)
    lazy = lazy_start([(QC_TOOL, "call_rest"), (QC_FN, "fn")], tag=tag, parallel=parallel)
    return _grammar(
        build,
        bodies,
        rules,
        lazy,
        (QC_TOOL, f"start: call_rest{more}"),
        lambda name, args: (
            f"{QC_TOOL}\n{QC_FN}{name}>\n",
            f"start: {args} {lit(QC_FN_END + NL)} {end}{more}",
        ),
    )


def glm(
    tools: Sequence[dict[str, Any]],
    *,
    tag: Tag,
    parallel: bool,
    only: Sequence[str] | None,
    newlines: bool = False,
) -> CallGrammar | None:
    """GLM-4.7's calls; `newlines` for GLM-4.5 and 4.6's layout."""
    build = _Builder(tag, GLM_MARKERS, GLM_VALUE_END, "")
    nl = f" {lit(NL)}" if newlines else ""
    key_open, key_close, value_open = tag(GLM_KEY), tag(GLM_KEY_END), tag(GLM_VALUE)

    def argument(key: str, rule: str) -> str:
        return f"{key_open} {lit(key)} {key_close}{nl} {value_open} {rule}{nl}"

    bodies = _functions(
        build,
        tool_defs(tools, only),
        lambda name: (
            len(name) <= 1024 and name == name.strip() and not _bad_glm(name) and NL not in name
        ),
        argument,
        _bad_glm_key,
        lambda name, seq: f"{lit(name)}{nl} {seq}",
    )
    if not bodies:
        return None
    end = tag(GLM_TOOL_END)
    more = f" ({nl} call)*" if parallel else ""
    rules = _rules(more, tag(GLM_TOOL), f"fn {end}", bodies, build.lines)
    lazy = lazy_start([(GLM_TOOL, "call_rest")], tag=tag, parallel=parallel)
    return _grammar(
        build,
        bodies,
        rules,
        lazy,
        (GLM_TOOL, f"start: call_rest{more}"),
        lambda name, args: (
            GLM_TOOL + name + (NL if newlines else ""),
            f"start: {args} {end}{more}",
        ),
    )


def _bad_glm_key(key: str) -> bool:
    """A key the parser would not read back whole (it strips it, splits at tags)."""
    return not key or key != key.strip() or _bad_glm(key)


def _bad_glm(text: str) -> bool:
    """Text the GLM parser would split: one holding a marker."""
    return any(m in text for m in GLM_MARKERS)
