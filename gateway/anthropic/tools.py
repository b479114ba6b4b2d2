"""Anthropic's tools and tool_choice -> the plan's ToolPlan. Custom tools are rendered;
Anthropic's own (web search, bash, text editor: the model was trained on their schemas,
which the request does not carry) are left out with one log line, and a tool_choice
naming one is a 400."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import MappingProxyType

from gateway.anthropic import wire
from gateway.core.errors import InvalidRequest
from gateway.core.plan import ToolPlan, tool_plan
from templates.types import Tool

log = logging.getLogger(__name__)


def _tools(req: wire.PromptRequest) -> tuple[list[Tool], list[str]]:
    """The custom tools to render, and the names of Anthropic's own tools left out."""
    tools: list[Tool] = []
    hosted: list[str] = []
    for j, t in enumerate(req.tools or ()):
        if t.type not in (None, "custom"):
            hosted.append(t.name or t.type)
            continue
        if not t.name:
            raise InvalidRequest(f"tools[{j}] has no name", param=f"tools[{j}].name")
        if t.input_schema is None:
            raise InvalidRequest(
                f"tools[{j}] ({t.name}) has no input_schema", param=f"tools[{j}].input_schema"
            )
        tools.append(Tool(t.name, t.description, MappingProxyType(t.input_schema)))
    if hosted:
        log.info("left out Anthropic-hosted tools this server cannot run: %s", ", ".join(hosted))
    return tools, hosted


def _tool_choice(
    choice: wire.ToolChoice | None, tools: Sequence[Tool], hosted: Sequence[str], sent: bool
) -> tuple[str, str | None]:
    if choice is None or choice.type == "auto":
        return ("auto" if tools else "none"), None
    if choice.type == "none":
        return "none", None
    if choice.type == "any":
        if not sent:
            raise InvalidRequest("tool_choice 'any' needs a non-empty tools list", param="tools")
        return "required", None
    name = choice.name
    if not name:
        raise InvalidRequest("tool_choice 'tool' needs a name", param="tool_choice.name")
    if name in hosted:
        raise InvalidRequest(
            f"tool_choice names {name!r}, an Anthropic-hosted tool this server cannot run",
            param="tool_choice.name",
        )
    if name not in {t.name for t in tools}:
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice.name"
        )
    return "named", name


def tools_of(req: wire.PromptRequest, *, supported: bool) -> ToolPlan:
    tools, hosted = _tools(req)
    choice, name = _tool_choice(req.tool_choice, tools, hosted, bool(req.tools))
    parallel = not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    return tool_plan(tools, choice, name, parallel, supported=supported)
