"""`mlx-gateway ps`, `show` and `rm`: ps against a live server (GET /admin/ps against its
schema, the table, the key and the environment launch reads), show on a tiny folder and a
tiny GGUF (facts checked against the files' own tensors), rm on a Hub cache laid out by
huggingface_hub's rules in a temporary folder, refused while a server has the model."""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from safetensors.numpy import load_file

from gateway.cli.main import main
from gateway.core.models import ModelRegistry, ModelSpec, build_served
from gateway.core.settings import ServerSettings
from tests.support.gguf_helpers import randomize, write_gguf
from tests.support.live_server import live_server

ENTRY_FIELDS: dict[str, Any] = {
    "id": {"type": "string"},
    "aliases": {"type": "array", "items": {"type": "string"}},
    "state": {"enum": ["loading", "loaded", "unloading"]},
    "source": {"type": "string"},
    "memory_bytes": {"type": "integer", "minimum": 0},
    "context_length": {"type": ["integer", "null"]},
    "dtype": {"type": ["string", "null"]},
    "quantized": {"type": ["boolean", "null"]},
    "idle_seconds": {"type": ["number", "null"]},
    "keep_alive_left_seconds": {"type": ["number", "null"], "minimum": 0},
    "requests_running": {"type": "integer", "minimum": 0},
    "requests_queued": {"type": "integer", "minimum": 0},
    "prefix_cache": {
        "type": ["object", "null"],
        "additionalProperties": False,
        "required": ["memory_bytes", "budget_bytes"],
        "properties": {
            "memory_bytes": {"type": "integer", "minimum": 0},
            "budget_bytes": {"type": "integer", "minimum": 0},
        },
    },
}
PS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["object", "keep_alive_seconds", "memory_budget_bytes", "models"],
    "properties": {
        "object": {"const": "list"},
        "keep_alive_seconds": {"type": "number", "minimum": 0},
        "memory_budget_bytes": {"type": "integer", "minimum": 0},
        "models": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": list(ENTRY_FIELDS),
                "properties": ENTRY_FIELDS,
            },
        },
    },
}
KEY = "sekrit-key"


@pytest.fixture(autouse=True)
def _no_gateway_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOST", "PORT", "API_KEY"):
        monkeypatch.delenv("MLX_GATEWAY_" + name, raising=False)


def _registry(path: Path, model_id: str = "tiny", keep_alive: float = 600) -> ModelRegistry:
    spec = ModelSpec(model_id, lambda: build_served(path, model_id=model_id), source=str(path))
    return ModelRegistry([spec], keep_alive=keep_alive)


@contextmanager
def _serving(path: Path, settings: ServerSettings | None = None) -> Iterator[str]:
    with live_server(_registry(path), settings) as url:
        yield url


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


def _get(url: str, key: str | None = None) -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as resp:
        return json.loads(resp.read())


def _chat(url: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 200


# -- ps --------------------------------------------------------------------------------------
def test_ps_shows_the_loaded_model(
    tiny_qwen3_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with _serving(tiny_qwen3_dir) as url:
        _chat(url)
        monkeypatch.setenv("MLX_GATEWAY_PORT", _port(url))  # found as launch finds it
        assert main(["ps", "--json"]) == 0
        body = json.loads(capsys.readouterr().out)
        trie = _get(url + "/debug/prefix-cache")["stats"]
        assert main(["ps"]) == 0
        table = capsys.readouterr().out
    jsonschema.validate(body, PS_SCHEMA)
    (entry,) = body["models"]
    assert entry["id"] == "tiny" and entry["state"] == "loaded"
    assert entry["source"] == str(tiny_qwen3_dir)
    assert entry["context_length"] == 65536 and entry["memory_bytes"] > 0
    assert entry["requests_running"] == 0 and entry["requests_queued"] == 0
    assert 0 <= entry["keep_alive_left_seconds"] <= 600
    assert entry["prefix_cache"]["memory_bytes"] == trie["paged_bytes"]
    assert entry["prefix_cache"]["budget_bytes"] == trie["budget_bytes"]
    header, row = table.strip().splitlines()
    assert header.split()[:3] == ["NAME", "STATE", "MEMORY"]
    assert row.split()[:2] == ["tiny", "loaded"]


def test_ps_with_a_key_and_without_a_server(
    tiny_qwen3_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with _serving(tiny_qwen3_dir, ServerSettings(api_key=KEY)) as url:
        port = _port(url)
        assert main(["ps", "--port", port]) == 1
        assert "wants an API key" in capsys.readouterr().err
        monkeypatch.setenv("MLX_GATEWAY_API_KEY", KEY)
        assert main(["ps", "--port", port, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["models"][0]["id"] == "tiny"
    assert main(["ps", "--port", NO_SERVER_PORT]) == 1
    assert "no gateway is running" in capsys.readouterr().err


# -- show ------------------------------------------------------------------------------------
def test_show_a_folder(tiny_qwen3_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tiny_qwen3_dir), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    weights = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    config = json.loads((tiny_qwen3_dir / "config.json").read_text())
    assert shown["model_type"] == "qwen3"
    assert shown["architecture_class"] == "Qwen3ForCausalLM"
    assert shown["parameters"] == sum(w.size for w in weights.values())
    assert shown["context_length"] == config["max_position_embeddings"]
    assert shown["embedding_length"] == config["hidden_size"]
    assert shown["quantization"] == "F32"
    assert shown["template"] == {"source": "model", "family": None, "parser": "hermes"}
    assert shown["capabilities"] == ["completion", "chat", "tools", "thinking"]
    assert shown["path"] == str(tiny_qwen3_dir)
    assert "model.safetensors" in shown["files"]
    assert main(["show", str(tiny_qwen3_dir)]) == 0
    text = capsys.readouterr().out
    assert "architecture      qwen3 (Qwen3ForCausalLM)" in text
    assert "context length    65536" in text


def test_show_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    randomize(model)
    path = tmp_path / "tiny-llama.gguf"
    meta = {
        "context_length": 512,
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
    }
    write_gguf(path, "llama", model, meta)
    assert main(["show", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["model_type"] == "llama"
    assert shown["parameters"] == sum(math.prod(p.shape) for p in model.state_dict().values())
    assert (shown["context_length"], shown["embedding_length"], shown["layers"]) == (512, 64, 2)
    assert shown["quantization"] == "F32"
    assert shown["template"]["source"] is not None  # write_gguf stores a chat template
    assert shown["files"] == [path.name]


# -- rm --------------------------------------------------------------------------------------
def _hub_cache(root: Path, repo_id: str, source: Path, commit: str) -> Path:
    """Put `source`'s files in a Hub cache as huggingface_hub lays one out: content-named
    blobs, a snapshot of relative links to them, and refs/main naming the commit."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))  # read once, at import
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(tmp_path / "home"))
    return root


COMMIT_A, COMMIT_B, COMMIT_C = "a" * 40, "b" * 40, "c" * 40
# a port nothing listens on: a free port found now may be taken by another test's server
# before the command runs (as happened under the parallel suite)
NO_SERVER_PORT = "1"


def _cached_repos(root: Path) -> dict[str, set[str]]:
    from huggingface_hub import scan_cache_dir

    repos = scan_cache_dir(root).repos
    return {r.repo_id: {rev.commit_hash for rev in r.revisions} for r in repos}


def test_rm_a_hub_snapshot(
    tiny_qwen3_dir: Path,
    hub_cache: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hub_cache(hub_cache, "org/tiny", tiny_qwen3_dir, COMMIT_A)
    _hub_cache(hub_cache, "org/tiny", tiny_qwen3_dir, COMMIT_B)
    _hub_cache(hub_cache, "org/other", tiny_qwen3_dir, COMMIT_C)
    no_server = ["--port", NO_SERVER_PORT]
    # show finds it in the cache without downloading
    assert main(["show", "org/tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"].endswith(COMMIT_B)  # refs/main
    # no terminal to ask on: refused without --yes
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    assert main(["rm", "org/tiny", *no_server]) == 2
    assert "without a terminal" in capsys.readouterr().err
    assert main(["rm", f"org/tiny@{COMMIT_B[:12]}", "--yes", *no_server]) == 0
    assert _cached_repos(hub_cache) == {"org/tiny": {COMMIT_A}, "org/other": {COMMIT_C}}
    assert main(["rm", "org/tiny", "--yes", *no_server]) == 0
    assert "removed 'org/tiny'" in capsys.readouterr().out
    assert _cached_repos(hub_cache) == {"org/other": {COMMIT_C}}
    assert not (hub_cache / "models--org--tiny").exists()
    assert main(["rm", "org/tiny", "--yes", *no_server]) == 1
    assert "not in the Hugging Face cache" in capsys.readouterr().err


def test_rm_refuses_a_model_a_server_has_loaded(
    tiny_qwen3_dir: Path, hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = _hub_cache(hub_cache, "org/tiny", tiny_qwen3_dir, COMMIT_A)
    with _serving(snapshot, ServerSettings(api_key=KEY)) as url:
        args = ["rm", "org/tiny", "--yes", "--port", _port(url)]
        assert main(args) == 1  # the server's list needs the key: rm cannot tell
        assert "wants an API key" in capsys.readouterr().err
        assert main([*args, "--api-key", KEY]) == 1
        err = capsys.readouterr().err
        assert "has 'org/tiny'" in err and "loaded (as 'tiny')" in err
        assert _cached_repos(hub_cache) == {"org/tiny": {COMMIT_A}}
    assert main(["rm", "org/tiny", "--yes", "--port", _port(url)]) == 0  # server gone


def test_rm_a_store_alias_and_never_a_path(
    tmp_path: Path, hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "home" / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
    no_server = ["--port", NO_SERVER_PORT]
    assert main(["rm", str(folder), "--yes", *no_server]) == 2
    assert "is a path" in capsys.readouterr().err
    assert main(["rm", "smollm2-135m", "--yes", *no_server]) == 0
    assert not folder.exists()
    assert main(["rm", "smollm2-135m", "--yes", *no_server]) == 1
    assert "not downloaded" in capsys.readouterr().err
