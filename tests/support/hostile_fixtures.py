"""Fixtures for the hostile-input tests: what the process opens (an audit hook), a file
no request may read, and a model store with a Hub that must not be asked."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.store import hub
from gateway.cli.store.names import RepoRef

_RECORDERS: list[list[str]] = []
_HOOKED: list[bool] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _RECORDERS and event == "open" and args and isinstance(args[0], (str, bytes, Path)):
        for opened in _RECORDERS:
            opened.append(os.fsdecode(args[0]))


@pytest.fixture(name="opened")
def opened_fixture() -> Iterator[list[str]]:
    """Every file path this process opens while the test runs (an audit hook: it sees
    opens in the server's threads too)."""
    if not _HOOKED:
        sys.addaudithook(_audit)  # hooks cannot be removed; this one idles between tests
        _HOOKED.append(True)
    paths: list[str] = []
    _RECORDERS.append(paths)
    yield paths
    _RECORDERS.remove(paths)


@pytest.fixture(name="secret")
def secret_fixture(tmp_path: Path) -> Path:
    """A file outside every model store that no request may read."""
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text("not a model")
    return path


@pytest.fixture(name="no_hub")
def no_hub_fixture(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private model store, and a Hub that fails the test if anything reaches it."""
    home = tmp_path / "home"
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(home))

    def refuse(ref: RepoRef, *, stream: object) -> Path:
        raise AssertionError(f"the Hub was asked for {ref}")

    monkeypatch.setattr(hub, "fetch", refuse)
    return home
