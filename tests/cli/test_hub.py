"""`pull` and `--model` with Hugging Face Hub repo ids, against a fake Hub on loopback.

The fake Hub answers what huggingface_hub (2.x) asks: `GET /api/models/{repo}/revision/
{rev}` (repo info: sha, siblings), `GET /api/models/{repo}/tree/{rev}` (the file listing
snapshot_download and list_repo_files read), `HEAD`/`GET /{repo}/resolve/{rev}/{path}`
(ETag, X-Repo-Commit, Content-Length; Range for a resumed download), and its errors as
`X-Error-Code` headers. The CLI runs as a subprocess with HF_ENDPOINT pointing at it and
HF_HOME in a temporary folder, so nothing reaches the internet or the user's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.support.live_server import free_port
from tests.support.tiny_models import VOCAB, make_tiny, write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_fake_token_for_tests"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
WANTED = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


# --- the fake Hub ---------------------------------------------------------------------------


@dataclass
class FakeRepo:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> files


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


class FakeHub:
    """Serves repos from memory; records every request; `cut[path] = n` breaks the next GET
    of that file off after n bytes (the resume test)."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.seen: list[Seen] = []
        self.cut: dict[str, int] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.handle(self, head=False)

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo_id: str, files: dict[str, bytes], *, ref: str = "main") -> str:
        commit = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, FakeRepo())
        repo.refs[ref] = commit
        repo.commits[commit] = dict(files)
        return commit

    # -- routing --

    def handle(self, req: BaseHTTPRequestHandler, *, head: bool) -> None:
        url = urlsplit(req.path)
        headers = {key.lower(): value for key, value in req.headers.items()}
        self.seen.append(Seen(req.command, unquote(url.path), headers))
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            if not rest:
                rest = ["revision", "main"]
            if len(rest) >= 2 and rest[0] == "revision":
                return self._info(req, repo_id, rest[1])
            if len(rest) >= 2 and rest[0] == "tree":
                recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
                return self._tree(req, repo_id, rest[1], "/".join(rest[2:]), recursive)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(req, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), head)
        return self._error(req, 404, "", "not a Hub route", head=head)

    def _commit(self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, head: bool) -> str:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(req, 404, "RepoNotFound", "Repository not found", head=head)
            return ""
        commit = repo.refs.get(rev) or (rev if rev in repo.commits else None)
        if commit is None:
            self._error(req, 404, "RevisionNotFound", "Invalid rev id", head=head)
            return ""
        return commit

    def _info(self, req: BaseHTTPRequestHandler, repo_id: str, rev: str) -> None:
        commit = self._commit(req, repo_id, rev, False)
        if commit:
            files = self.repos[repo_id].commits[commit]
            body = {
                "id": repo_id,
                "sha": commit,
                "private": False,
                "gated": False,
                "lastModified": "2025-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": name} for name in sorted(files)],
            }
            self._json(req, body)

    def _tree(
        self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, under: str, recursive: bool
    ) -> None:
        commit = self._commit(req, repo_id, rev, False)
        if not commit:
            return
        prefix = f"{under}/" if under else ""
        entries: dict[str, dict[str, Any]] = {}
        for name, data in sorted(self.repos[repo_id].commits[commit].items()):
            if not name.startswith(prefix):
                continue
            rel = name[len(prefix) :].split("/")
            for depth in range(1, len(rel)):  # the folders on the way
                folder = prefix + "/".join(rel[:depth])
                if recursive or depth == 1:
                    entries[folder] = {"type": "directory", "path": folder, "oid": "0" * 40}
            if recursive or len(rel) == 1:
                entries[name] = _file_entry(name, data)
        self._json(req, list(entries.values()))

    def _resolve(
        self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, path: str, head: bool
    ) -> None:
        commit = self._commit(req, repo_id, rev, head)
        if not commit:
            return
        data = self.repos[repo_id].commits[commit].get(path)
        if data is None:
            extra = {"X-Repo-Commit": commit}
            self._error(req, 404, "EntryNotFound", "Entry not found", head=head, extra=extra)
            return
        start = 0
        wanted = req.headers.get("Range")
        if wanted and not head:
            start = int(wanted.removeprefix("bytes=").split("-")[0])
        req.send_response(206 if start else 200)
        req.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        req.send_header("X-Repo-Commit", commit)
        req.send_header("Accept-Ranges", "bytes")
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(len(data) - start))
        if start:
            req.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        req.end_headers()
        if head:
            return
        cut = self.cut.pop(path, None)
        body = data[start:] if cut is None else data[start:cut]
        req.wfile.write(body)  # after a cut the connection closes short of Content-Length

    def _json(self, req: BaseHTTPRequestHandler, body: object) -> None:
        raw = json.dumps(body).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(raw)))
        req.end_headers()
        req.wfile.write(raw)

    def _error(
        self,
        req: BaseHTTPRequestHandler,
        status: int,
        code: str,
        message: str,
        *,
        head: bool,
        extra: dict[str, str] | None = None,
    ) -> None:
        raw = json.dumps({"error": message}).encode()
        req.send_response(status)
        if code:
            req.send_header("X-Error-Code", code)
        req.send_header("X-Error-Message", message)
        for key, value in (extra or {}).items():
            req.send_header(key, value)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(raw)))
        req.end_headers()
        if not head:
            req.wfile.write(raw)


def _file_entry(name: str, data: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": "file",
        "path": name,
        "size": len(data),
        "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
    }
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {
            "oid": hashlib.sha256(data).hexdigest(),
            "size": len(data),
            "pointerSize": 134,
        }
    return entry


# --- fixtures -------------------------------------------------------------------------------


@dataclass
class Repos:
    hub: FakeHub
    main: dict[str, bytes]
    main_commit: str
    v1: dict[str, bytes]
    v1_commit: str
    ggufs: dict[str, bytes]


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _tiny_gguf(path: Path, fill: float) -> bytes:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.context_length", 16)
    writer.add_tensor("token_embd.weight", np.full((4, 8), fill, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Repos]:
    base = tmp_path_factory.mktemp("hub-files")
    for seed in (0, 1):
        make_tiny("qwen2", base / f"seed{seed}", seed=seed)
        write_tokenizer(base / f"seed{seed}", VOCAB)
    main = _folder_files(base / "seed0")
    v1 = _folder_files(base / "seed1")
    noise = {
        "README.md": b"# tiny\n",
        "pytorch_model.bin": b"\0" * 64,
        "consolidated.safetensors": b"\0" * 64,
        "onnx/model.safetensors": b"\0" * 64,
    }
    ggufs = {
        "tiny-F32.gguf": _tiny_gguf(base / "a.gguf", 0.5),
        "tiny-Q8_0.gguf": _tiny_gguf(base / "b.gguf", 1.5),
    }
    hub = FakeHub()
    main_commit = hub.add("org/tiny", {**main, **noise})
    v1_commit = hub.add("org/tiny", v1, ref="v1")
    hub.add("org/tiny-GGUF", {**ggufs, "README.md": b"quants\n"})
    hub.add("org/one-GGUF", {"sub/only-Q4_K_M.gguf": ggufs["tiny-F32.gguf"]})
    hub.thread.start()
    try:
        yield Repos(hub, main, main_commit, v1, v1_commit, ggufs)
    finally:
        hub.server.shutdown()
        hub.server.server_close()


@pytest.fixture
def env(repos: Repos, tmp_path: Path) -> dict[str, str]:
    repos.hub.seen.clear()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MLX_GATEWAY_"))}
    return {
        **clean,
        "HF_ENDPOINT": repos.hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "MLX_GATEWAY_HOME": str(tmp_path / "gateway"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def pulled(env: dict[str, str], name: str) -> Path:
    result = cli(env, "pull", name)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stdout.splitlines()  # pull prints the path, and nothing else on stdout
    return Path(line)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0 and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert "Traceback" not in result.stderr, result.stderr
    [line] = errors
    assert line.startswith("mlx-gateway: error: ")
    return line


# --- pulling --------------------------------------------------------------------------------


def test_pull_repo_fetches_only_what_the_loader_reads(repos: Repos, env: dict[str, str]) -> None:
    path = pulled(env, "org/tiny")
    snapshots = Path(env["HF_HOME"]) / "hub" / "models--org--tiny" / "snapshots"
    assert path == snapshots / repos.main_commit  # the Hub client's own cache, under HF_HOME
    assert _folder_files(path) == {name: repos.main[name] for name in sorted(WANTED)}
    fetched = {s.path.rsplit("/", 1)[-1] for s in repos.hub.seen if s.method == "GET"}
    assert not fetched & {"README.md", "pytorch_model.bin", "consolidated.safetensors"}
    model_requests = [s for s in repos.hub.seen if "/models/" in s.path or "/resolve/" in s.path]
    assert all(s.headers.get("authorization") == f"Bearer {TOKEN}" for s in model_requests)
    # a second pull finds the snapshot complete and downloads no file again
    repos.hub.seen.clear()
    assert pulled(env, "org/tiny") == path
    assert not any(s.method == "GET" and "/resolve/" in s.path for s in repos.hub.seen)


def test_pull_by_revision_tag_or_commit(repos: Repos, env: dict[str, str]) -> None:
    by_tag = pulled(env, "org/tiny@v1")
    assert by_tag.name == repos.v1_commit
    assert _folder_files(by_tag) == {name: repos.v1[name] for name in sorted(WANTED)}
    assert _folder_files(by_tag)["model.safetensors"] != repos.main["model.safetensors"]
    assert pulled(env, f"org/tiny@{repos.v1_commit}") == by_tag


def test_pull_a_gguf_file_by_name_or_quant(repos: Repos, env: dict[str, str]) -> None:
    by_name = pulled(env, "org/tiny-GGUF:tiny-F32.gguf")
    assert by_name.name == "tiny-F32.gguf"
    assert by_name.read_bytes() == repos.ggufs["tiny-F32.gguf"]
    by_quant = pulled(env, "org/tiny-GGUF@main:q8_0")
    assert by_quant.name == "tiny-Q8_0.gguf"
    assert by_quant.read_bytes() == repos.ggufs["tiny-Q8_0.gguf"]
    only = pulled(env, "org/one-GGUF")  # a repo with one GGUF file needs no file name
    assert only.as_posix().endswith("sub/only-Q4_K_M.gguf")
    assert only.read_bytes()[:4] == b"GGUF"


def test_a_gguf_repo_with_several_files_asks_for_one(repos: Repos, env: dict[str, str]) -> None:
    result = cli(env, "pull", "org/tiny-GGUF")
    line = one_error_line(result)
    assert result.returncode == 2
    assert "name one" in line and "org/tiny-GGUF:tiny-F32.gguf" in line
    assert "tiny-Q8_0.gguf" in line


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("org/nothing", "no model repo 'org/nothing'"),
        ("org/tiny@v9", "has no revision 'v9'"),
        ("org/tiny-GGUF:absent.gguf", "has no file 'absent.gguf'"),
        ("org/tiny-GGUF:Q2_K", "has no GGUF file for 'Q2_K'"),
        ("org/nothing:Q4_K_M", "no model repo 'org/nothing'"),
        ("org/tiny-GGUF@v2:Q8_0", "has no revision 'v2'"),
    ],
)
def test_unknown_repo_revision_or_file_is_one_line(
    repos: Repos, env: dict[str, str], name: str, says: str
) -> None:
    result = cli(env, "pull", name)
    line = one_error_line(result)
    assert result.returncode == 1 and says in line


def test_gguf_file_error_lists_the_files_there_are(repos: Repos, env: dict[str, str]) -> None:
    line = one_error_line(cli(env, "pull", "org/tiny-GGUF:absent.gguf"))
    assert "tiny-F32.gguf, tiny-Q8_0.gguf" in line


def test_a_broken_download_resumes_with_a_range_request(repos: Repos, env: dict[str, str]) -> None:
    # the Hub client writes in 10 MiB chunks, so only a bigger file shows a resume
    weights = np.random.default_rng(0).bytes(12 << 20)
    repos.hub.add("org/big", {"config.json": b"{}", "model.safetensors": weights})
    repos.hub.cut["model.safetensors"] = 11 << 20
    path = pulled(env, "org/big")
    assert (path / "model.safetensors").read_bytes() == weights
    gets = [s for s in repos.hub.seen if s.method == "GET" and s.path.endswith(".safetensors")]
    assert [s.headers.get("range") for s in gets] == [None, f"bytes={10 << 20}-"]


def test_the_cache_serves_without_the_hub(repos: Repos, env: dict[str, str]) -> None:
    path = pulled(env, "org/tiny")
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    assert pulled(offline, "org/tiny") == path
    for name in ("org/tiny-GGUF:tiny-F32.gguf", "org/tiny-GGUF:Q8_0", "org/one-GGUF"):
        assert "not in the cache" in one_error_line(cli(offline, "pull", name))
    gguf = pulled(env, "org/tiny-GGUF:Q8_0")
    assert pulled(offline, "org/tiny-GGUF:Q8_0") == gguf  # the quant found in the cache
    assert pulled(offline, "org/tiny-GGUF:tiny-Q8_0.gguf") == gguf
    gone = {**env, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    assert pulled(gone, "org/tiny") == path
    result = cli(gone, "pull", "org/tiny@v1")
    assert "cannot reach" in one_error_line(result) and result.returncode == 1


# --- serving --------------------------------------------------------------------------------


def test_serve_model_from_the_hub(repos: Repos, env: dict[str, str]) -> None:
    port = free_port()
    args = ["serve", "--model", "org/tiny", "--port", str(port), "--max-batch", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli.main", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{base}/health").json().get("model_loaded"):
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        ids = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
        assert "org/tiny" in ids
        body = {"model": "org/tiny", "prompt": "w5 w6 w7", "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 3
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    resolved = [s.path for s in repos.hub.seen if "/resolve/" in s.path]
    assert any(p.endswith("/model.safetensors") for p in resolved)
