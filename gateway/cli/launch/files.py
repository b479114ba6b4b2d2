"""Writing the files a client reads: atomically, only when the bytes change, and never
without keeping the previous version.

Each replaced or removed file is first copied to `<gateway home>/backups/<client>/`
as `<name>.<UTC time>`; the newest five copies of each file name are kept. The new
bytes go to a temporary file in the target's own folder (so the rename stays on one
file system) and `os.replace` swaps it in: a crash leaves the old file or the new one,
never half of either.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.cli.store.store import gateway_home

KEEP_BACKUPS = 5


def backup_root() -> Path:
    return gateway_home() / "backups"


@dataclass(frozen=True)
class Written:
    """What one write did: `changed` is False when the file already held these bytes."""

    path: Path
    changed: bool
    backup: Path | None


def _stamp() -> str:
    # Sortable as text, and unique even for several writes in one second.
    now = time.time_ns()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 1_000_000_000)) + (
        f".{now % 1_000_000_000:09d}Z"
    )


def backup(path: Path, client: str) -> Path:
    """Copy `path` into the client's backup folder and prune old copies of it."""
    folder = backup_root() / client
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{path.name}.{_stamp()}"
    target.write_bytes(path.read_bytes())
    with contextlib.suppress(OSError):
        os.chmod(target, path.stat().st_mode & 0o777)
    prune(client, path.name)
    return target


def backups_of(name: str, client: str) -> list[Path]:
    """The backups of one file name, oldest first."""
    folder = backup_root() / client
    if not folder.is_dir():
        return []
    prefix = name + "."
    found = [p for p in folder.iterdir() if p.name.startswith(prefix) and p.is_file()]
    # The stamp after the prefix sorts in time order; a name that merely shares the
    # prefix ("config.toml.bak.x") would have a non-digit right after it.
    return sorted(p for p in found if p.name[len(prefix) : len(prefix) + 1].isdigit())


def prune(client: str, name: str, keep: int = KEEP_BACKUPS) -> None:
    """Delete all but the newest `keep` backups of one file name."""
    for old in backups_of(name, client)[:-keep] if keep > 0 else []:
        with contextlib.suppress(OSError):
            old.unlink()


def write_atomic(path: Path, data: bytes, client: str, *, mode: int = 0o644) -> Written:
    """Make `path` hold `data`: nothing happens if it already does; else the old file is
    backed up and replaced in one rename. An existing file keeps its permissions."""
    old: bytes | None = None
    if path.exists():
        old = path.read_bytes()
        if old == data:
            return Written(path, changed=False, backup=None)
        mode = path.stat().st_mode & 0o777
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = backup(path, client) if old is not None else None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Written(path, changed=True, backup=saved)


def remove_with_backup(path: Path, client: str) -> Path | None:
    """Delete `path` after backing it up; None when there was nothing to delete."""
    if not path.exists():
        return None
    saved = backup(path, client)
    path.unlink()
    return saved
