"""opencode: the provider and model passed inline in OPENCODE_CONFIG_CONTENT, which
opencode merges over the user's own config files; no file is written."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.cli.launch.base import (
    PROVIDER_ID,
    Client,
    EnvPlan,
    Invocation,
    Target,
    option_conflict,
)


def config(target: Target) -> dict[str, Any]:
    model: dict[str, Any] = {"name": target.model, "tool_call": True}
    limit: dict[str, int] = {"output": target.max_output}
    if target.context_length:
        limit["context"] = target.context_length
    model["limit"] = limit  # opencode sends limit.output as max_tokens (else 32000)
    if target.vision:
        model["modalities"] = {"input": ["text", "image"], "output": ["text"]}
    if target.thinking:
        model["reasoning"] = True
    ref = f"{PROVIDER_ID}/{target.model}"
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlx-gateway",
                "options": {"baseURL": target.v1_url, "apiKey": target.key},
                "models": {target.model: model},
            }
        },
        "model": ref,
        # Session titles and summaries use the small model; the served one, not a
        # hosted default.
        "small_model": ref,
    }


class OpenCode(Client):
    name = "opencode"
    title = "opencode"
    binary = "opencode"
    install = "npm install -g opencode-ai"
    prompt_tokens = 7_200  # opencode_first_request_chat.json
    extra_dirs = (".opencode/bin",)  # where opencode's own installer puts it

    def conflict(self, args: Sequence[str]) -> str | None:
        arg = option_conflict(args, ("--model",), ("-m",))
        if arg is None:
            return None
        return (
            f"`{arg}` would send opencode to another model; launch sets "
            f"{PROVIDER_ID}/<served model> (use launch's own --model to pick what is served)"
        )

    def invocation(
        self, exe: Path, target: Target, args: Sequence[str], base_env: Mapping[str, str]
    ) -> Invocation:
        content = json.dumps(config(target), separators=(",", ":"))
        env = EnvPlan(forced={"OPENCODE_CONFIG_CONTENT": content}).apply(base_env)
        return Invocation([str(exe), *args], env)
