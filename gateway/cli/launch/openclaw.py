"""OpenClaw: a `models.providers.mlx-gateway` entry and the default agent model merged
into its config file (~/.openclaw/openclaw.json), every other key kept as it was.

OpenClaw talks to the gateway over `/v1/chat/completions` (`api: "openai-completions"`):
its docs name that adapter for self-hosted OpenAI-compatible servers, and it is the
dialect with the longest record here. The model it used before launch changed it is
remembered, so `--restore` can put it back.

When the gateway serves an embedding model (or --embedding-model names one), OpenClaw's
memory search embeds with it: `memory.search.provider` names the same provider entry
(OpenClaw reads an `openai-completions` provider as an OpenAI-compatible
/v1/embeddings endpoint at its baseUrl, with its key) and `memory.search.model` the
model. The memory.search keys that chose the user's embedding provider are remembered
for --restore; the others (sources, extra paths, query tuning) stay as they are."""

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
    LaunchError,
    PlannedFile,
    Target,
    option_conflict,
)
from gateway.cli.launch.binaries import find_node
from gateway.cli.launch.files import write_atomic
from gateway.cli.store.store import gateway_home

API = "openai-completions"
TIMEOUT_S = 3600  # model requests on a CPU can take minutes before the first token
# OpenClaw accepts a non-secret marker as the key of a loopback provider, and then sends
# no Authorization header at all.
LOCAL_KEY_MARKER = "mlx-gateway-local"


def config_path() -> Path:
    explicit = os.environ.get("OPENCLAW_CONFIG_PATH")
    if explicit:
        return Path(explicit).expanduser()
    state = os.environ.get("OPENCLAW_STATE_DIR")
    base = Path(state).expanduser() if state else Path.home() / ".openclaw"
    return base / "openclaw.json"


def state_path() -> Path:
    """Where launch remembers the default model it replaced."""
    return gateway_home() / "launch" / "openclaw.json"


def read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    text = path.read_text()
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        raise LaunchError(
            f"{path} is not plain JSON (JSON5 comments or trailing commas?); launch will "
            "not rewrite it and lose them. Add the provider with OpenClaw's own editor:\n"
            f"  openclaw config set models.providers.{PROVIDER_ID} '<json>' --strict-json "
            "--merge\n(run `mlx-gateway launch openclaw --config` on a plain-JSON copy to "
            "see the JSON)"
        ) from None
    if not isinstance(data, dict):
        raise LaunchError(f"{path} does not hold a JSON object")
    return data


def _table(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = parent.setdefault(key, {})
    if not isinstance(value, dict):
        raise LaunchError(f"`{where}` in the OpenClaw config is not an object; fix it first")
    return value


def model_entry(target: Target) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": target.model,
        "name": target.model,
        "reasoning": target.thinking,
        "input": ["text", "image"] if target.vision else ["text"],
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
        "maxTokens": target.max_output,
    }
    if target.context_length:
        entry["contextWindow"] = target.context_length
    return entry


# memory.search keys that choose and reach an embedding provider: replaced by launch's
# provider and model, put back by --restore
MEMORY_PROVIDER_KEYS = (
    "provider", "model", "remote", "fallback", "local", "outputDimensionality",
    "inputType", "queryInputType", "documentInputType",
)  # fmt: skip


def merged(config: dict[str, Any], target: Target) -> dict[str, Any]:
    """`config` with our provider, default model and (given an embedding model) memory
    search set; all else untouched."""
    out = json.loads(json.dumps(config))  # a deep copy
    providers = _table(_table(out, "models", "models"), "providers", "models.providers")
    provider = providers.get(PROVIDER_ID)
    provider = dict(provider) if isinstance(provider, dict) else {}
    provider["baseUrl"] = target.v1_url
    # With a key, OpenClaw substitutes ${VAR} from launch's environment: the key itself
    # is not written to disk.
    provider["apiKey"] = f"${{{KEY_ENV}}}" if target.api_key else LOCAL_KEY_MARKER
    provider["api"] = API
    provider.setdefault("timeoutSeconds", TIMEOUT_S)
    # One row, for the served model; settings the user added to that row are kept.
    old_rows = provider.get("models")
    rows = old_rows if isinstance(old_rows, list) else []
    same = [r for r in rows if isinstance(r, dict) and r.get("id") == target.model]
    provider["models"] = [{**(same[0] if same else {}), **model_entry(target)}]
    providers[PROVIDER_ID] = provider
    defaults = _table(_table(out, "agents", "agents"), "defaults", "agents.defaults")
    model = defaults.get("model")
    model = dict(model) if isinstance(model, dict) else {}
    model["primary"] = f"{PROVIDER_ID}/{target.model}"
    defaults["model"] = model
    if target.embedding_model:
        search = _table(_table(out, "memory", "memory"), "search", "memory.search")
        for key in MEMORY_PROVIDER_KEYS:
            search.pop(key, None)
        search["provider"] = PROVIDER_ID
        search["model"] = target.embedding_model
    return out


def dump(config: dict[str, Any]) -> bytes:
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()


def _primary(config: dict[str, Any]) -> Any:
    model = (_defaults(config) or {}).get("model")
    return model.get("primary") if isinstance(model, dict) else model


def _ours(primary: Any) -> bool:
    return isinstance(primary, str) and primary.startswith(PROVIDER_ID + "/")


def _search(config: dict[str, Any]) -> dict[str, Any] | None:
    memory = config.get("memory")
    search = memory.get("search") if isinstance(memory, dict) else None
    return search if isinstance(search, dict) else None


def _search_ours(config: dict[str, Any]) -> bool:
    return (_search(config) or {}).get("provider") == PROVIDER_ID


def _read_state() -> dict[str, Any]:
    try:
        state = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


class OpenClaw(Client):
    name = "openclaw"
    title = "OpenClaw"
    binary = "openclaw"
    install = "npm install -g openclaw"
    prompt_tokens = 8_450  # openclaw_first_request_chat.json

    def __init__(self) -> None:
        self._node: Path | None = None

    def conflict(self, args: Sequence[str]) -> str | None:
        arg = option_conflict(args, ("--model", "--profile", "--dev", "--container"))
        if arg is None:
            return None
        return (
            f"`{arg}` would make OpenClaw use another model or another config than the "
            f"one launch writes ({config_path()})"
        )

    def preflight(self, exe: Path) -> None:
        self._node = find_node(exe, self.title)

    def files(self, target: Target) -> list[PlannedFile]:
        path = config_path()
        current = read_config(path)
        question = None
        if current:
            question = (
                f"Add the {PROVIDER_ID} provider to {path} and make {PROVIDER_ID}/"
                f"{target.model} OpenClaw's default model (the file is backed up first)?"
            )
        planned = [PlannedFile(state_path(), dump(self._state(path, current, target)))]
        # 0600 for a new file: OpenClaw keeps gateway tokens in it.
        planned.append(PlannedFile(path, dump(merged(current, target)), question, 0o600))
        return planned

    def _state(self, path: Path, current: dict[str, Any], target: Target) -> dict[str, Any]:
        """What to put back on --restore. A setting that is already launch's keeps what
        an earlier launch remembered, so a second launch does not overwrite it."""
        old = _read_state()
        state: dict[str, Any] = {"config": str(path)}
        if _ours(_primary(current)):
            state["model"] = old.get("model")
        else:
            state["model"] = (_defaults(current) or {}).get("model")
        if _search_ours(current) and "memory_search" in old:
            state["memory_search"] = old["memory_search"]
        elif target.embedding_model and not _search_ours(current):
            search = _search(current) or {}
            state["memory_search"] = {k: search[k] for k in MEMORY_PROVIDER_KEYS if k in search}
        return state

    def notes(self, target: Target) -> list[str]:
        if target.embedding_model:
            return [
                f"OpenClaw's memory search embeds with {target.embedding_model} on the gateway "
                "(rebuild an index made with another model or gateway address: `openclaw "
                "memory index --force`)"
            ]
        return [
            "OpenClaw's memory search is left as it was: the gateway serves no embedding "
            "model (serve one beside the chat model, or pass --embedding-model NAME)"
        ]

    def invocation(
        self, exe: Path, target: Target, args: Sequence[str], base_env: Mapping[str, str]
    ) -> Invocation:
        forced = {KEY_ENV: target.api_key} if target.api_key else {}
        if self._node is not None:
            # openclaw is a `#!/usr/bin/env node` script: the first node on PATH runs it.
            path = base_env.get("PATH", os.defpath)
            forced["PATH"] = str(self._node.parent) + os.pathsep + path
        argv = [str(exe), *(args or ["chat"])]  # chat: OpenClaw's local terminal UI
        return Invocation(argv, EnvPlan(forced=forced).apply(base_env))

    def restore(self, out: TextIO) -> None:
        path = config_path()
        config = read_config(path)
        if not config:
            out.write(f"{path}: not there, nothing to restore\n")
            return
        models = config.get("models")
        providers = models.get("providers") if isinstance(models, dict) else None
        if isinstance(providers, dict):
            providers.pop(PROVIDER_ID, None)
        state = _read_state()
        _restore_model(config, state.get("model"))
        _restore_search(config, state.get("memory_search"))
        _drop_empty(config, ("models", "providers"))
        _drop_empty(config, ("agents", "defaults"))
        _drop_empty(config, ("memory", "search"))
        written = write_atomic(path, dump(config), self.name)
        if written.changed:
            out.write(f"restored {path} (the version before is in {written.backup})\n")
        else:
            out.write(f"{path} holds nothing launch added\n")
        state_path().unlink(missing_ok=True)


def _defaults(config: dict[str, Any]) -> dict[str, Any] | None:
    agents = config.get("agents")
    defaults = agents.get("defaults") if isinstance(agents, dict) else None
    return defaults if isinstance(defaults, dict) else None


def _restore_search(config: dict[str, Any], previous: Any) -> None:
    """Put back the memory.search keys that chose the user's embedding provider."""
    search = _search(config)
    if search is None or not _search_ours(config):
        return
    for key in MEMORY_PROVIDER_KEYS:
        search.pop(key, None)
    if isinstance(previous, dict):
        search.update(previous)


def _restore_model(config: dict[str, Any], previous: Any) -> None:
    """Put back the default model launch replaced (or remove ours if there was none)."""
    defaults = _defaults(config)
    if defaults is None or not _ours(_primary(config)):
        return
    model = defaults["model"]
    if isinstance(model, dict) and set(model) != {"primary"}:
        # The user added settings next to ours since: keep them, swap only primary.
        old = previous.get("primary") if isinstance(previous, dict) else previous
        if old is None:
            model.pop("primary")
        else:
            model["primary"] = old
    elif previous is None:
        defaults.pop("model")
    else:
        defaults["model"] = previous


def _drop_empty(config: dict[str, Any], keys: tuple[str, str]) -> None:
    outer = config.get(keys[0])
    if not isinstance(outer, dict):
        return
    if outer.get(keys[1]) == {}:
        outer.pop(keys[1])
    if not outer:
        config.pop(keys[0])
