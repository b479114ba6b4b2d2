"""The project's structural promises: layers (import-linter), ruff, mypy strict."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed")
    return found


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_layers_contract_holds() -> None:
    out = _run(_tool("lint-imports"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_clean() -> None:
    out = _run(
        _tool("ruff"), "check", "gateway", "runtime", "parsers", "templates", "tests", "bench"
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_clean() -> None:
    out = _run(_tool("mypy"))
    assert out.returncode == 0, out.stdout + out.stderr
