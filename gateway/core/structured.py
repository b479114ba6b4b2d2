"""Structured output: every dialect's response format becomes one runtime `Constraint`
on the plan; `request_constraint` then fits it to the rendered prompt (a reasoning block
left free, tool calls still possible, a forced call's grammar).

A schema the grammar engine cannot compile is a 400 naming what it cannot do, never a
silently unconstrained run. Tool parameter schemas are compiled leniently instead: the
client wrote them for its own tools, not as an output contract, and refusing Claude
Code's (which use `propertyNames`) would refuse the client; the keywords the engine
does not implement are then not enforced, the rest of the schema is.

Tool calls: a forced call (tool_choice required / named) runs under its format's call
grammar from the opener on; with tool_choice auto the reply is free text in which a
call opener starts a call that the grammar then keeps to (declared tool, valid
arguments): the model is never made to call. A custom tool's own grammar (Responses'
`format: {type: grammar}`) constrains its input inside the call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.core.limits import check_grammar_size, check_schema_size
from gateway.core.plan import ChatPlan
from parsers.grammars import CallGrammar, GrammarTooLarge, call_grammar, custom_lark, free_calls
from runtime.text import ConstraintError, Tokenizer, check, json_schema_constraint, lark_constraint
from runtime.types import Constraint, ReasoningLead

ANY_OBJECT: Mapping[str, Any] = {"type": "object"}
_ANSWER = "answer"  # the response format's grammar, nested next to the tool calls


def _refusal(exc: ConstraintError, param: str) -> InvalidRequest:
    if exc.keywords:
        names = ", ".join(repr(k) for k in exc.keywords)
        what = "this keyword" if len(exc.keywords) == 1 else "these keywords"
        message = (
            f"{param} uses {names}, which this server's grammar engine (llguidance) "
            f"cannot enforce; remove {what} from the schema"
        )
    else:
        message = f"{param} cannot be compiled into a grammar: {exc}"
    return InvalidRequest(message, param=param, code="unsupported_schema")


def json_output(schema: Any, *, param: str) -> Constraint:
    """Output that is one JSON document valid against `schema` (a JSON schema sent in
    the request at `param`), or a 400 if the schema cannot be enforced."""
    if not isinstance(schema, (Mapping, bool)):
        raise InvalidRequest(f"{param} must be a JSON schema object", param=param)
    check_schema_size(schema, param=param)
    try:
        constraint = json_schema_constraint(schema, name=param)
        check(constraint)
    except ConstraintError as exc:
        raise _refusal(exc, param) from None
    return constraint


def format_constraint(
    kind: str, schema: Any, *, param: str, schema_param: str, kinds: tuple[str, ...]
) -> Constraint | None:
    """A dialect's format object: `kind` its type ("text", "json_object" or
    "json_schema", those of them in `kinds`), `schema` the schema it carries."""
    if kind not in kinds:
        raise InvalidRequest(
            f"{param}.type must be one of {', '.join(repr(k) for k in kinds)}, not {kind!r}",
            param=f"{param}.type",
        )
    if kind == "text":
        return None
    if kind == "json_object" or schema is None:
        return json_output(ANY_OBJECT, param=param)
    return json_output(schema, param=schema_param)


# -- fitting the plan's constraint to the prepared request --------------------------------


def marker_tag(tokenizer: Tokenizer) -> Callable[[str], str]:
    """A format's marker as a grammar item: its token when the vocabulary has it as one
    added token (the engine sees those as special: text cannot spell them), else its
    text."""
    added = {t.content: i for i, t in tokenizer.hf.get_added_tokens_decoder().items()}

    def tag(marker: str) -> str:
        token = added.get(marker)
        return f"<[{token}]>" if token is not None else _literal(marker)

    return tag


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _calls(plan: ChatPlan, parser: str, tag: Callable[[str], str]) -> CallGrammar | None:
    tools = plan.tools
    names = (tools.name,) if tools.choice == "named" and tools.name else None
    try:
        return call_grammar(parser, tools.schemas, tag=tag, parallel=tools.parallel, only=names)
    except GrammarTooLarge as exc:
        # refused while it was being flattened: the memory and work stay bounded
        raise InvalidRequest(
            f"tools: {exc}: write the grammar with fewer rules that use another rule more "
            "than once",
            param="tools",
            code="grammar_too_large",
        ) from None


def forced_call(plan: ChatPlan, parser: str, tokenizer: Tokenizer) -> CallGrammar | None:
    """The grammar of a call forced by tool_choice required / named, for formats that
    have one (None: the opener in the prompt is all that forces the call)."""
    if plan.tools.choice not in ("required", "named"):
        return None
    return _calls(plan, parser, marker_tag(tokenizer))


def request_constraint(
    plan: ChatPlan,
    parser: str,
    think: bool | str,
    tokenizer: Tokenizer,
    forced: CallGrammar | None,
) -> Constraint | None:
    """What the generation runs under. A forced call's grammar continues the opener the
    prompt ends with; otherwise, behind a free reasoning block (`think` as
    parsers.think_mode says), the response format's grammar next to the tool calls the
    model may make instead of answering, or with tools on auto and no response format,
    free text in which the calls the model opens keep to their grammar."""
    if forced is not None:
        return _checked(Constraint(forced.after_opener, forced.parts, name="tools"))
    if plan.tools.choice in ("required", "named"):
        return None  # a format without a grammar: the opener alone forces the call
    answer = plan.constraint
    reasoning: ReasoningLead = "open" if think == "open" else ("optional" if think else "none")
    if plan.tools.choice == "auto" and plan.tools.tools:
        tag = marker_tag(tokenizer)
        grammar = _calls(plan, parser, tag)
        if answer is None:
            if grammar is None:
                return None
            lazy = _checked(Constraint(grammar.lazy, grammar.parts, name="tools"))
            return replace(lazy, reasoning=reasoning)
        calls = grammar.rules if grammar is not None else free_calls(parser, tag=tag)
        if calls is not None:
            main = f"start: @{_ANSWER} | calls\n{calls}"
            parts = ((_ANSWER, answer.grammar), *answer.parts)
            parts += grammar.parts if grammar is not None else ()
            answer = _checked(Constraint(main, parts, name=answer.name))
    if answer is None:
        return None
    return replace(answer, reasoning=reasoning)


def custom_tool_grammar(fmt: Mapping[str, Any] | None, *, param: str) -> dict[str, str] | None:
    """A custom tool's `format` as the annotation (parsers.grammars.GRAMMAR_KEY) of its
    string input: None for free text; a grammar the engine cannot compile is a 400
    naming the problem, never a silently unconstrained input."""
    if not fmt or fmt.get("type") != "grammar":
        return None
    syntax = fmt.get("syntax") or "lark"
    if syntax not in ("lark", "regex"):
        raise InvalidRequest(
            f"{param}.syntax must be 'lark' or 'regex', not {syntax!r}", param=f"{param}.syntax"
        )
    definition = fmt.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise InvalidRequest(
            f"{param}.definition must be the {syntax} grammar's text", param=f"{param}.definition"
        )
    check_grammar_size(definition, param=f"{param}.definition")
    try:
        check(lark_constraint(custom_lark(syntax, definition), name=param))
    except ConstraintError as exc:
        raise InvalidRequest(
            f"{param}.definition: this {syntax} grammar cannot be compiled by the server's "
            f"grammar engine (llguidance): {exc}",
            param=f"{param}.definition",
            code="invalid_grammar",
        ) from None
    return {"syntax": syntax, "definition": definition}


def _checked(constraint: Constraint) -> Constraint:
    """A grammar built from the tools: one that fails names the tools as the cause
    (their schemas compile leniently, so only a broken schema, a bad $ref say, fails)."""
    try:
        check(constraint)
    except ConstraintError as exc:
        raise InvalidRequest(
            f"a tool's parameters schema cannot be compiled into a grammar: {exc}",
            param="tools",
            code="unsupported_schema",
        ) from None
    return constraint
