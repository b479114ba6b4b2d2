"""Model names on the command line: aliases, local paths and Hugging Face Hub repo ids.

A Hub reference is `org/name`, then optionally `@revision` (a branch, tag or commit) and
`:file` (one file of the repo, for GGUF repos that hold one file per quant):
`mlx-community/Qwen3-4B-4bit`, `org/name@v1.0`, `org/name@main:model-Q4_K_M.gguf`.
Everything here is pure string checking; nothing touches the disk or the network.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from gateway.cli.errors import BadModelName

HUB_SYNTAX = "org/name[@revision][:file.gguf]"
MAX_NAME_CHARS = 512

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
_FILE_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")
_DRIVE = re.compile(r"[A-Za-z]:[\\/]")


@dataclass(frozen=True)
class RepoRef:
    """A model on the Hugging Face Hub: a repo, a revision (None: the default branch) and
    optionally one file of it."""

    repo_id: str
    revision: str | None = None
    filename: str | None = None

    def __str__(self) -> str:
        revision = f"@{self.revision}" if self.revision else ""
        filename = f":{self.filename}" if self.filename else ""
        return f"{self.repo_id}{revision}{filename}"


def check_text(text: str) -> None:
    """Refuse what neither a name nor a path holds: nothing at all, control or format
    characters (echoed back they could rewrite the terminal), or thousands of them."""
    if not text.strip():
        raise BadModelName("empty model name: give an alias, a path or a Hub repo id")
    if len(text) > MAX_NAME_CHARS:
        raise BadModelName(
            f"model name too long ({len(text)} characters, at most {MAX_NAME_CHARS})"
        )
    if any(unicodedata.category(c) in ("Cc", "Cf") for c in text):
        raise BadModelName(
            f"model name {text!r} contains control characters; give an alias, a path or a "
            f"Hub repo id ({HUB_SYNTAX})"
        )


def looks_like_path(text: str) -> bool:
    """Spelled as a file-system path: absolute, home- or dot-relative, Windows-style, or a
    bare `*.gguf` file name. (`org/name` is a repo id unless such a folder exists.)"""
    if text in (".", "..") or text.startswith(("/", "~", "./", "../", ".\\", "..\\")):
        return True
    if "\\" in text or _DRIVE.match(text):
        return True
    return "/" not in text and text.lower().endswith(".gguf")


def parse_repo_ref(text: str) -> RepoRef | None:
    """`org/name[@revision][:file]` -> RepoRef; None when `text` has no `/` before any `@`
    or `:` (an alias or a typo of one). Raises BadModelName when it has the shape of a repo
    id but a part is malformed: `..` anywhere, extra slashes, odd characters."""
    if "://" in text:
        raise BadModelName(
            f"'{text}' is a URL; give the Hub repo id instead ({HUB_SYNTAX}), "
            "e.g. mlx-community/Qwen3-4B-4bit"
        )
    head, colon, filename = text.partition(":")
    repo_id, at, revision = head.partition("@")
    if "/" not in repo_id:
        return None
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_valid_segment(p) for p in parts):
        raise BadModelName(
            f"'{text}' is neither an existing path nor a Hugging Face repo id ({HUB_SYNTAX}; "
            "letters, digits, '-', '_' and '.', no '..')"
        )
    if at and not _valid_revision(revision):
        raise BadModelName(
            f"'{revision}' is not a revision: give a branch, tag or commit hash after '@' "
            f"({HUB_SYNTAX})"
        )
    if colon and not _valid_filename(filename):
        raise BadModelName(
            f"'{filename}' is not a file name in a repo: give a path inside the repo after "
            f"':', without '..' or a leading '/' ({HUB_SYNTAX})"
        )
    return RepoRef(repo_id, revision if at else None, filename if colon else None)


def check_pull_name(text: str) -> None:
    """`pull` takes a name (an alias or a repo id), never a path: a path has nothing to
    download, and `../../etc/passwd` must not be looked up, let alone fetched to."""
    check_text(text)
    if looks_like_path(text):
        raise BadModelName(
            f"`pull` takes a model name, not a path: '{text}'. Give an alias or a Hugging Face "
            f"repo id ({HUB_SYNTAX}); to serve a local model, use `serve --model PATH`"
        )


def _valid_segment(segment: str) -> bool:
    # the Hub's own rules: no '--' or '..', no leading or trailing '-' or '.'
    return (
        _SEGMENT.fullmatch(segment) is not None
        and ".." not in segment
        and "--" not in segment
        and not segment.endswith(("-", "."))
    )


def _valid_revision(revision: str) -> bool:
    return (
        _REVISION.fullmatch(revision) is not None
        and ".." not in revision
        and "//" not in revision
        and not revision.endswith("/")
    )


def _valid_filename(filename: str) -> bool:
    # each part starts with a letter, digit or '_': rules out '..', '.', hidden files, ''
    return len(filename) <= MAX_NAME_CHARS and all(
        _FILE_PART.fullmatch(part) is not None for part in filename.split("/")
    )
