"""`mlx-gateway rm MODEL`: remove what `pull` stored for a model: an alias's folder in
our store, or a Hub repo's snapshots in the Hugging Face cache (through
huggingface_hub's cache API: `scan_cache_dir` and `delete_revisions`; `@revision` limits
it to that revision). A path is never removed (it is not ours). A model a running
gateway has loaded is refused (GET /admin/ps at --host/--port says; with no gateway
running, rm goes ahead). It asks first unless --yes, and without a terminal to ask on
it refuses unless --yes.

    mlx-gateway rm MODEL [--yes] [--host H] [--port P] [--api-key K]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gateway.cli.errors import FAILED, CliError
from gateway.cli.remote import Server, loaded_models
from gateway.cli.store.names import RepoRef, check_text, looks_like_path, parse_repo_ref
from gateway.cli.store.store import Store, UnknownModel


@dataclass(frozen=True)
class Removal:
    """What `rm` would delete: a description, its folders, the bytes freed, and how."""

    what: str
    names: tuple[str, ...]  # the names a server may serve it under
    paths: tuple[Path, ...]
    size: int
    execute: Callable[[], None]


def _dir_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _store_removal(store: Store, name: str) -> Removal:
    spec = store.spec(name)
    folder = store.path_for(name).parent
    if not folder.exists():
        raise CliError(f"'{spec.alias}' is not downloaded (nothing at {folder})", FAILED)
    return Removal(
        what=f"'{spec.alias}' ({folder})",
        names=(spec.alias, name),
        paths=(folder,),
        size=_dir_size(folder),
        execute=lambda: shutil.rmtree(folder),
    )


def _hub_removal(ref: RepoRef) -> Removal:
    # imported on use: the Hub client is slow to import and only a repo id needs it
    from huggingface_hub import constants, scan_cache_dir

    cache = scan_cache_dir(constants.HF_HUB_CACHE)  # where hub.py's downloads go
    repo = next(
        (r for r in cache.repos if r.repo_type == "model" and r.repo_id == ref.repo_id), None
    )
    if repo is None:
        raise CliError(
            f"'{ref.repo_id}' is not in the Hugging Face cache ({constants.HF_HUB_CACHE})",
            FAILED,
        )
    revisions = sorted(repo.revisions, key=lambda r: r.commit_hash)
    if ref.revision:
        revisions = [
            r for r in revisions if ref.revision in r.refs or r.commit_hash.startswith(ref.revision)
        ]
        if not revisions:
            raise CliError(
                f"the cache holds no revision '{ref.revision}' of '{ref.repo_id}' (it holds "
                f"{', '.join(r.commit_hash[:12] for r in repo.revisions)})",
                FAILED,
            )
    which = ", ".join(r.commit_hash[:12] for r in revisions)
    if len(revisions) == len(repo.revisions):  # the whole repo folder
        folder = repo.repo_path
        return Removal(
            what=f"'{ref.repo_id}' revision {which} ({folder})",
            names=(ref.repo_id, str(ref)),
            paths=(folder,),
            size=repo.size_on_disk,
            execute=lambda: shutil.rmtree(folder),
        )
    # delete_revisions matches commit hashes in every repo of the cache (a fork shares
    # its parent's): only this repo's files may go
    strategy = cache.delete_revisions(*(r.commit_hash for r in revisions))
    touched = [*strategy.blobs, *strategy.refs, *strategy.repos, *strategy.snapshots]
    if any(not Path(p).is_relative_to(repo.repo_path) for p in touched):
        raise CliError(
            f"revision {which} of '{ref.repo_id}' is shared with another cached repo; remove "
            "the whole repo instead",
            FAILED,
        )
    return Removal(
        what=f"'{ref.repo_id}' revision {which} ({repo.repo_path})",
        names=(ref.repo_id, str(ref)),
        paths=tuple(r.snapshot_path for r in revisions),
        size=strategy.expected_freed_size,
        execute=strategy.execute,
    )


def plan(name: str, store: Store) -> Removal:
    """What removing `name` deletes; a path or an unknown name is refused."""
    check_text(name)
    if name.lower() in store.aliases:
        return _store_removal(store, name)
    if looks_like_path(name) or Path(name).expanduser().exists():
        raise CliError(
            f"'{name}' is a path: rm removes only what `mlx-gateway pull` stored (an alias "
            "or a Hub repo id); delete your own files yourself"
        )
    ref = parse_repo_ref(name)
    if ref is None:
        raise UnknownModel(name, store.aliases)
    return _hub_removal(ref)


def _inside(source: str, paths: Sequence[Path]) -> bool:
    # absolute, not resolved: a Hub snapshot's files are links into the repo's blobs
    where = Path(os.path.abspath(source))
    return any(where == p or p in where.parents for p in map(Path.absolute, paths))


def loaded_as(removal: Removal, body: Mapping[str, Any]) -> str | None:
    """The id under which the server's /admin/ps shows the model loaded, if it does."""
    for entry in body.get("models", []):
        if not isinstance(entry, dict):
            continue
        served = {entry.get("id"), *(entry.get("aliases") or [])}
        source = entry.get("source")
        if served & set(removal.names) or (
            isinstance(source, str) and source and _inside(source, removal.paths)
        ):
            return str(entry.get("id"))
    return None


def _confirm(removal: Removal, yes: bool, stdin: TextIO, out: TextIO) -> bool:
    if yes:
        return True
    if not stdin.isatty():
        raise CliError(f"refusing to remove {removal.what} without a terminal to ask; pass --yes")
    out.write(f"remove {removal.what}, {removal.size / 1e6:.1f} MB? [y/N] ")
    out.flush()
    return stdin.readline().strip().lower() in ("y", "yes")


def rm(args: argparse.Namespace, out: TextIO | None = None, stdin: TextIO | None = None) -> int:
    out = out or sys.stdout
    removal = plan(args.model, Store())
    server = Server.of(args)
    body = loaded_models(server)
    served_as = None if body is None else loaded_as(removal, body)
    if served_as is not None:
        raise CliError(
            f"the gateway at {server.root_url} has {removal.what} loaded (as '{served_as}'); "
            "stop it, or let its keep-alive unload the model, then run rm again",
            FAILED,
        )
    if not _confirm(removal, args.yes, stdin or sys.stdin, out):
        out.write("nothing removed\n")
        return FAILED
    removal.execute()
    out.write(f"removed {removal.what}, {removal.size / 1e6:.1f} MB freed\n")
    return 0
