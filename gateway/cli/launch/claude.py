"""Claude Code: pointed at the gateway's Anthropic Messages API through its environment
alone; no file of the user's is touched."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from gateway.cli.launch.base import ROOM, Client, EnvPlan, Invocation, Target, option_conflict

# Local prefill is slow on a CPU (Claude Code's first request is ~19k tokens: 20-30
# minutes for Qwen2.5-Coder-0.5B on two busy cores). Claude Code gives up on a request
# after 10 minutes, and on a stream after 5 minutes without an event; the gateway's
# `ping` keepalives do not count (its SDK drops them before the watchdog sees them), so
# it would abort and resend the request over and over while the prompt is prefilled.
SLOW_PREFILL_MS = str(60 * 60 * 1000)


# Claude Code 2.1 compacts when the prompt passes context - min(reply budget, 20k) - 13k.
_COMPACT_RESERVE_CAP, _COMPACT_BUFFER = 20_000, 13_000
_PROMPT_TOKENS = 18_700  # its first request with a custom model name (see Claude below)


def compacts_at_once(target: Target) -> bool:
    """Whether auto-compaction would start before the first request even fits: then
    every turn would compact (and the compaction request would not fit either)."""
    ctx = target.context_length
    if ctx is None:
        return False
    threshold = ctx - min(target.max_output, _COMPACT_RESERVE_CAP) - _COMPACT_BUFFER
    return threshold < _PROMPT_TOKENS + ROOM


def environment(target: Target) -> EnvPlan:
    model = target.model
    forced = {
        "ANTHROPIC_BASE_URL": target.root_url,  # the client appends /v1/messages itself
        "ANTHROPIC_AUTH_TOKEN": target.key,
        "ANTHROPIC_API_KEY": "",  # else a key in the user's shell would be sent instead
        # Every tier Claude Code picks a model for (main loop, background and title
        # calls, subagents) gets the served model rather than a name we do not serve.
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,  # the older name of the haiku tier; still read
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        # Both put text into the prompt that changes every request, so the prefix cache
        # would miss on every turn: the billing header (cc_version=...; cch=...) and a
        # running token-count reminder.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_TOTAL_TOKENS_REMINDER": "off",
    }
    if target.context_length:
        ctx = str(target.context_length)
        # Claude Code assumes 200k for a model it does not know; this is the context it
        # uses for non-"claude-" model names. Its auto-compact window is raised to at
        # least 100k and then capped by that context, so it needs both.
        forced["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = ctx
        forced["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = ctx
    defaults = {
        # Its default reply budget (32k) is also what it reserves out of the context
        # before compacting; a local context needs a budget that leaves room.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(target.max_output),
        "API_TIMEOUT_MS": SLOW_PREFILL_MS,
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": SLOW_PREFILL_MS,
        # A local session makes no calls elsewhere: telemetry, error reports, update
        # checks, feedback surveys.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_FEEDBACK_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    }
    if compacts_at_once(target):
        # Then Claude Code works up to the context's end and stops there; /compact by
        # hand still works.
        defaults["DISABLE_AUTO_COMPACT"] = "1"
    # Any of these would route requests to a cloud provider instead of the gateway.
    removed = ("CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY")
    return EnvPlan(forced=forced, defaults=defaults, removed=removed)


class Claude(Client):
    name = "claude"
    title = "Claude Code"
    binary = "claude"
    install = "npm install -g @anthropic-ai/claude-code"
    prompt_tokens = _PROMPT_TOKENS  # claude_code_first_request_custom_model.json
    extra_dirs = (".local/bin", ".claude/local")  # where Anthropic's own installer puts it

    def conflict(self, args: Sequence[str]) -> str | None:
        arg = option_conflict(args, ("--model", "--fallback-model"))
        if arg is None:
            return None
        return (
            f"`{arg}` would send Claude Code to a model the gateway does not serve; "
            "launch sets the model (use launch's own --model to pick what is served)"
        )

    def invocation(
        self, exe: Path, target: Target, args: Sequence[str], base_env: Mapping[str, str]
    ) -> Invocation:
        argv = [str(exe), "--model", target.model, *args]
        return Invocation(argv, environment(target).apply(base_env))
