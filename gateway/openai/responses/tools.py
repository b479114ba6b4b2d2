"""Responses tools -> template tools: function, custom (with its grammar) and namespace
tools; hosted ones left out with a log line; tool_choice to the neutral tool plan.

A namespace's tool reaches the model under a flat name ("<namespace>.<name>"); `ToolRef`
maps the model's calls back to the kind and name the client declared.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from gateway.core.errors import InvalidRequest
from gateway.core.plan import (
    ToolPlan,
)
from gateway.core.plan import tool_plan as neutral_tool_plan
from gateway.core.structured import custom_tool_grammar
from gateway.openai.responses.wire import ResponsesRequest
from gateway.openai.responses.wire import Tool as WireTool
from parsers.grammars import GRAMMAR_KEY
from templates.types import Tool

log = logging.getLogger(__name__)

# Tools OpenAI runs on its side (or that belong to its own models' trained formats):
# a local server cannot run them, and Codex always sends some, so they are left out
# of the prompt with a log line rather than refused.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26",
    "web_search_preview_2025_03_11", "file_search", "code_interpreter",
    "image_generation", "computer", "computer_use", "computer_use_preview", "mcp",
    "tool_search", "local_shell", "shell", "apply_patch",
})  # fmt: skip
GRAMMAR_SHOWN = 4000  # longest custom-tool grammar written into the tool's description
NAMESPACE_SEP = "."  # a namespace's tool is offered to the model as "<namespace>.<name>"


@dataclass(frozen=True)
class ToolRef:
    """What a tool name in the prompt stands for, to map the model's calls back."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


ToolNames = Mapping[str, ToolRef]


def flat_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


def refuse(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", param=param, code="unsupported_parameter")


# -- tools ----------------------------------------------------------------------------


def _custom_parameters() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "The tool's free-form input."}},
        "required": ["input"],
        "additionalProperties": False,
    }


def _custom_description(tool: WireTool) -> str | None:
    fmt = tool.format or {}
    if fmt.get("type") != "grammar":
        return tool.description
    syntax = str(fmt.get("syntax") or "lark")
    definition = str(fmt.get("definition") or "")
    if len(definition) <= GRAMMAR_SHOWN:
        rule = f"The `input` string must match this {syntax} grammar:\n{definition}"
    else:
        rule = f"The `input` string must follow a {syntax} grammar (too long to show here)."
    return f"{tool.description}\n\n{rule}" if tool.description else rule


def _one_tool(tool: WireTool, where: str, namespace: str | None) -> tuple[Tool, ToolRef] | None:
    if tool.type not in ("function", "custom"):
        if tool.type in HOSTED_TOOLS:
            log.info(
                "%s: %r is a built-in OpenAI tool, not offered here; left out", where, tool.type
            )
        else:
            log.warning("%s: unknown tool type %r; left out of the prompt", where, tool.type)
        return None
    if not tool.name:
        raise InvalidRequest(f"{where} ({tool.type}) has no name", param=f"{where}.name")
    name = flat_name(tool.name, namespace)
    if tool.type == "function":
        rendered = Tool(name, tool.description, MappingProxyType(tool.parameters or {}))
        return rendered, ToolRef("function", tool.name, namespace)
    params = MappingProxyType(_custom_parameters())
    return Tool(name, _custom_description(tool), params), ToolRef("custom", tool.name, namespace)


def tools_of(tools: Sequence[WireTool] | None) -> tuple[list[Tool], dict[str, ToolRef]]:
    """The tools the model sees (namespaces flattened) and what each name stands for."""
    rendered: list[Tool] = []
    names: dict[str, ToolRef] = {}
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if tool.type == "namespace":
            if not tool.name:
                raise InvalidRequest(f"{where} (namespace) has no name", param=f"{where}.name")
            namespace: str | None = tool.name
            inner = [(t, f"{where}.tools[{j}]") for j, t in enumerate(tool.tools or ())]
        else:
            namespace, inner = None, [(tool, where)]
        for t, at in inner:
            one = _one_tool(t, at, namespace)
            if one is not None:
                rendered.append(one[0])
                names[one[0].name] = one[1]
    return rendered, names


def _find(names: ToolNames, kind: str, choice: Mapping[str, Any], param: str) -> str:
    name = choice.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(
            f'a {kind} tool_choice must look like {{"type": "{kind}", "name": ...}}', param=param
        )
    namespace = choice.get("namespace")
    flat = flat_name(name, namespace if isinstance(namespace, str) else None)
    if flat in names and names[flat].kind == kind:
        return flat
    # a namespaced tool may be named by its own name when that is unambiguous
    found = [k for k, ref in names.items() if ref.kind == kind and ref.name == name]
    if len(found) == 1:
        return found[0]
    raise InvalidRequest(f"{param} names {kind} tool {name!r}, which is not in tools", param=param)


def _allowed(names: ToolNames, choice: Mapping[str, Any]) -> tuple[str, frozenset[str]]:
    mode = choice.get("mode")
    if mode not in ("auto", "required"):
        raise InvalidRequest(
            "tool_choice allowed_tools needs mode 'auto' or 'required'", param="tool_choice.mode"
        )
    allowed: set[str] = set()
    for j, entry in enumerate(choice.get("tools") or ()):
        param = f"tool_choice.tools[{j}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind in ("function", "custom"):
            allowed.add(_find(names, kind, entry, param))
        elif kind in HOSTED_TOOLS:
            log.info("%s: hosted tool %r left out", param, kind)
        else:
            raise InvalidRequest(f"{param} is not a function or custom tool", param=param)
    return str(mode), frozenset(allowed)


def _choice(
    choice: str | dict[str, Any] | None, names: ToolNames
) -> tuple[str, str | None, frozenset[str] | None]:
    """(none|auto|required|named, the named tool, the allowed subset or None)."""
    if choice is None:
        return ("auto" if names else "none"), None, None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"tool_choice {choice!r} is not none, auto, required or a tool", param="tool_choice"
            )
        if choice == "required" and not names:
            raise InvalidRequest(
                "tool_choice 'required' needs a function or custom tool in tools", param="tools"
            )
        return (choice if names else "none"), None, None
    kind = choice.get("type")
    if kind in ("function", "custom"):
        return "named", _find(names, kind, choice, "tool_choice"), None
    if kind == "allowed_tools":
        mode, allowed = _allowed(names, choice)
        if not allowed:
            if mode == "required":
                raise InvalidRequest(
                    "tool_choice allowed_tools 'required' allows no function or custom tool",
                    param="tool_choice",
                )
            return "none", None, None
        if mode == "required" and len(allowed) == 1:
            return "named", next(iter(allowed)), allowed
        return mode, None, allowed
    raise refuse(
        "tool_choice",
        f"{kind!r} forces a hosted tool, which this server cannot run; use a function or "
        "custom tool, 'auto', 'required' or 'none'",
    )


def tool_plan(req: ResponsesRequest, *, supported: bool) -> tuple[ToolPlan, dict[str, ToolRef]]:
    rendered, names = tools_of(req.tools)
    choice, name, allowed = _choice(req.tool_choice, names)
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    plan = neutral_tool_plan(rendered, choice, name, parallel, supported=supported)
    if allowed is not None and plan.schemas:
        # every tool stays in the prompt (so the cached prefix holds), but only the
        # allowed ones are read back as calls
        kept = tuple(s for s in plan.schemas if s["function"]["name"] in allowed)
        plan = dataclasses.replace(plan, schemas=kept)
    grammars = _input_grammars(req.tools)
    if grammars and plan.schemas:
        schemas = tuple(_with_grammar(s, grammars.get(s["function"]["name"])) for s in plan.schemas)
        plan = dataclasses.replace(plan, schemas=schemas)
    return plan, names


def _input_grammars(tools: Sequence[WireTool] | None) -> dict[str, dict[str, str]]:
    """The grammar of each custom tool whose format is one, by the name the model sees
    (a 400 for a grammar the engine cannot compile)."""
    found: dict[str, dict[str, str]] = {}
    for i, tool in enumerate(tools or ()):
        if tool.type == "namespace":
            inner = [
                (t, f"tools[{i}].tools[{j}]", tool.name) for j, t in enumerate(tool.tools or ())
            ]
        else:
            inner = [(tool, f"tools[{i}]", None)]
        for t, where, namespace in inner:
            if t.type != "custom" or not t.name:
                continue
            grammar = custom_tool_grammar(t.format, param=f"{where}.format")
            if grammar is not None:
                found[flat_name(t.name, namespace)] = grammar
    return found


def _with_grammar(schema: dict[str, Any], grammar: dict[str, str] | None) -> dict[str, Any]:
    """A custom tool's schema for the output side (the call grammar and the parser):
    its `input` carries the tool's grammar. The prompt shows the tool without it."""
    if grammar is None:
        return schema
    params = dict(schema["function"]["parameters"])
    props = dict(params.get("properties") or {})
    props["input"] = {**props.get("input", {"type": "string"}), GRAMMAR_KEY: grammar}
    params["properties"] = props
    return {**schema, "function": {**schema["function"], "parameters": params}}
