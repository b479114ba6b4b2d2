"""Events a parser turns model text into. Leaf module: imports nothing of ours."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = Content | Reasoning | ToolCallStart | ToolCallArgs | ToolCallEnd
