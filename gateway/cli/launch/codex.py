"""Codex: a profile file of our own next to the user's config.toml, selected with
`codex --profile mlx-gateway` (Codex layers `$CODEX_HOME/<name>.config.toml` over the
user's config), plus a model catalog that tells Codex the served model's context window.
The user's config.toml is never read or written."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from gateway.cli.launch.base import (
    KEY_ENV,
    PROVIDER_ID,
    Client,
    EnvPlan,
    Invocation,
    PlannedFile,
    Target,
    option_conflict,
)
from gateway.cli.launch.files import remove_with_backup

PROFILE = PROVIDER_ID
# A stream that stays quiet this long is dropped and retried by Codex; a local prefill of
# a long prompt can take many minutes before the first token.
STREAM_IDLE_TIMEOUT_MS = 60 * 60 * 1000

# Replaces Codex's built-in ~4k-token instructions (written for its hosted models), which
# alone would fill half of a small local context; the tool descriptions still come along.
INSTRUCTIONS = (
    "You are a coding agent running in the Codex CLI in the user's terminal. Work in the "
    "current directory. Use the tools you are given to read files and run commands "
    "instead of guessing what they contain. Make the smallest change that does what the "
    "user asked, then say briefly what you did."
)

# `-c KEY=...` overrides that would replace what the profile sets.
_MANAGED_KEYS = ("model", "model_provider", "model_catalog_json", "profile")


def codex_home() -> Path:
    return Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex").expanduser()


def profile_path() -> Path:
    return codex_home() / f"{PROFILE}.config.toml"


def catalog_path() -> Path:
    return codex_home() / f"{PROFILE}.models.json"


def _toml(value: str) -> str:
    # A JSON string with ASCII escapes is a valid TOML basic string.
    return json.dumps(value)


def profile_text(target: Target, catalog: Path) -> str:
    lines = [
        "# Written by `mlx-gateway launch codex` and used as `codex --profile mlx-gateway`.",
        "# Rewritten on every launch; `mlx-gateway launch codex --restore` removes it.",
        f"model = {_toml(target.model)}",
        f"model_provider = {_toml(PROVIDER_ID)}",
        f"model_catalog_json = {_toml(str(catalog))}",
        "",
        f"[model_providers.{PROVIDER_ID}]",
        f"name = {_toml('mlx-gateway')}",
        f"base_url = {_toml(target.v1_url)}",
        'wire_api = "responses"',
        f"stream_idle_timeout_ms = {STREAM_IDLE_TIMEOUT_MS}",
    ]
    if target.api_key:
        # Codex reads the key from this variable, which launch sets; the key itself is
        # never written to disk.
        lines.append(f"env_key = {_toml(KEY_ENV)}")
    return "\n".join(lines) + "\n"


def catalog_entry(target: Target) -> dict[str, Any]:
    levels = (
        [
            {"effort": effort, "description": f"{effort} reasoning"}
            for effort in ("low", "medium", "high")
        ]
        if target.thinking
        else []
    )
    entry: dict[str, Any] = {
        "slug": target.model,
        "display_name": target.model,
        "description": f"{target.model} served by mlx-gateway at {target.root_url}",
        "supported_reasoning_levels": levels,
        "shell_type": "default",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 0,
        "upgrade": None,
        "base_instructions": INSTRUCTIONS,
        "supports_reasoning_summaries": target.thinking,
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": None,
        "truncation_policy": {"mode": "bytes", "limit": 10_000},
        "supports_parallel_tool_calls": False,
        "experimental_supported_tools": [],
        "input_modalities": ["text", "image"] if target.vision else ["text"],
    }
    if target.thinking:
        entry["default_reasoning_level"] = "medium"
    if target.context_length:
        entry["context_window"] = target.context_length
    return entry


def catalog_text(target: Target) -> str:
    return json.dumps({"models": [catalog_entry(target)]}, indent=2) + "\n"


def _config_conflict(args: Sequence[str]) -> str | None:
    """A `-c key=value` / `--config key=value` that sets a key the profile manages."""
    for i, arg in enumerate(args):
        if arg == "--":
            return None
        value = None
        if arg in ("-c", "--config") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--config="):
            value = arg.removeprefix("--config=")
        elif arg.startswith("-c") and len(arg) > 2:
            value = arg[2:]
        if value is None or "=" not in value:
            continue
        key = value.split("=", 1)[0].strip().strip("\"'")
        if key in _MANAGED_KEYS or key.startswith("model_providers."):
            return f"-c {value}"
    return None


class Codex(Client):
    name = "codex"
    title = "Codex"
    binary = "codex"
    install = "npm install -g @openai/codex"
    # codex_first_request.json holds ~8.4k tokens, ~4k of them Codex's own instructions;
    # with INSTRUCTIONS in their place, launch's first request measured 4.7k.
    prompt_tokens = 4_700

    def conflict(self, args: Sequence[str]) -> str | None:
        arg = option_conflict(args, ("--model", "--profile", "--oss", "--local-provider"))
        arg = arg or option_conflict(args, (), ("-m", "-p"))
        arg = arg or _config_conflict(args)
        if arg is None:
            return None
        return (
            f"`{arg}` would switch Codex to another model, provider or profile; launch "
            f"selects its own (profile {PROFILE}, provider {PROVIDER_ID}, the served model)"
        )

    def files(self, target: Target) -> list[PlannedFile]:
        catalog = catalog_path()
        return [
            PlannedFile(catalog, catalog_text(target).encode()),
            PlannedFile(profile_path(), profile_text(target, catalog).encode()),
        ]

    def invocation(
        self, exe: Path, target: Target, args: Sequence[str], base_env: Mapping[str, str]
    ) -> Invocation:
        forced = {KEY_ENV: target.api_key} if target.api_key else {}
        env = EnvPlan(forced=forced).apply(base_env)
        return Invocation([str(exe), "--profile", PROFILE, *args], env)

    def restore(self, out: TextIO) -> None:
        for path in (profile_path(), catalog_path()):
            saved = remove_with_backup(path, self.name)
            if saved is None:
                out.write(f"{path}: not there, nothing to remove\n")
            else:
                out.write(f"removed {path} (a copy is in {saved})\n")
        out.write(f"{codex_home() / 'config.toml'} was never changed by launch\n")
