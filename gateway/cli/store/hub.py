"""Models from the Hugging Face Hub, fetched with `huggingface_hub`.

Everything the Hub client offers comes with it: its cache (`HF_HOME`, `HF_HUB_CACHE`;
files shared with transformers and mlx-lm), its token (`HF_TOKEN` or `hf auth login`), its
progress bars, retries that resume a broken download with a Range request, `HF_ENDPOINT`
(a mirror) and `HF_HUB_OFFLINE` (the cache only). A repo without a named file gives a
Hugging Face folder (only the files the loader reads), else its one GGUF file; `:file.gguf`
or `:QUANT` picks one file of a GGUF repo.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from gateway.cli.errors import FAILED, USAGE, StoreError
from gateway.cli.progress import note
from gateway.cli.store.names import RepoRef

# What the loader reads from a Hugging Face folder; nothing else is downloaded.
MODEL_FILES = (
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "preprocessor_config.json",
)
# Subfolders (onnx/, original/, a second quant) hold copies in other layouts, and
# consolidated*.safetensors is Mistral's native-format duplicate of the weights.
SKIPPED_FILES = ("*/*", "consolidated*.safetensors")
_LISTED_FILES = 8


class HubError(StoreError):
    """The Hub could not give the model: no such repo, revision or file, no network."""

    def __init__(self, message: str, exit_code: int = FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def fetch(ref: RepoRef, *, stream: TextIO) -> Path:
    """Download `ref` into the Hub cache (or find it there) and return the model's path: a
    snapshot folder, or one GGUF file in it."""
    from huggingface_hub import constants

    note(stream, f"looking up {ref} on {constants.ENDPOINT}")
    with _hub_errors(ref):
        if ref.filename is None:
            path = _download_repo(ref)
        elif ref.filename.lower().endswith(".gguf"):
            path = _download_file(ref, ref.filename)
        else:  # a quant tag
            path = _download_file(ref, _pick_gguf(ref, _gguf_files(ref), ref.filename))
    note(stream, f"{ref} is at {path}")
    return path


def _download_repo(ref: RepoRef) -> Path:
    from huggingface_hub import snapshot_download

    folder = Path(
        snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            allow_patterns=list(MODEL_FILES),
            ignore_patterns=list(SKIPPED_FILES),
        )
    )
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    return _download_file(ref, _pick_gguf(ref, _gguf_files(ref, folder), None))


def _download_file(ref: RepoRef, filename: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        return Path(hf_hub_download(ref.repo_id, filename, revision=ref.revision))
    except RemoteEntryNotFoundError:
        at = f" at revision '{ref.revision}'" if ref.revision else ""
        raise HubError(f"'{ref.repo_id}' has no file '{filename}'{at}{_files_hint(ref)}") from None


def _gguf_files(ref: RepoRef, cached: Path | None = None) -> list[str]:
    """The repo's .gguf files from the Hub; when it cannot be reached, those in the cached
    snapshot (`cached`, else the one the cache's refs name)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    try:
        names = HfApi().list_repo_files(ref.repo_id, revision=ref.revision)
    except HfHubHTTPError:
        raise  # the Hub answered: no such repo or revision, ...
    except Exception:  # no connection, or HF_HUB_OFFLINE: the cache is all there is
        folder = cached or _cached_snapshot(ref)
        if folder is None:
            raise HubError(
                f"cannot reach {constants.ENDPOINT} to list the files of '{ref}', and it is "
                f"not in the cache ({constants.HF_HUB_CACHE}); check the network, "
                "$HF_ENDPOINT and $HF_HUB_OFFLINE"
            ) from None
        names = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")]
    return sorted(n for n in names if n.lower().endswith(".gguf"))


def _cached_snapshot(ref: RepoRef) -> Path | None:
    """The cache's snapshot folder for the revision, as huggingface_hub lays it out."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(
        repo_id=ref.repo_id, repo_type="model"
    )
    revision = ref.revision or constants.DEFAULT_REVISION
    pointer = storage / "refs" / revision  # names were checked: no '..' in a revision
    commit = pointer.read_text().strip() if pointer.is_file() else revision
    folder = storage / "snapshots" / commit
    return folder if folder.is_dir() else None


def _files_hint(ref: RepoRef) -> str:
    try:
        files = _gguf_files(ref)
    except Exception:  # only a hint in an error message already on its way
        return ""
    return f"; its GGUF files: {_some(files)}" if files else ""


def _pick_gguf(ref: RepoRef, files: list[str], tag: str | None) -> str:
    """One file: the only one, or the one whose name carries the quant `tag` (`Q4_K_M`)."""
    if tag is not None:
        word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
        files = [f for f in files if word.search(f.rsplit("/", 1)[-1])]
    # vision projectors ship next to the weights in GGUF repos; they are not a model
    files = [f for f in files if "mmproj" not in f.lower()] or files
    if len(files) == 1:
        return files[0]
    if not files and tag is not None:
        raise HubError(f"'{ref.repo_id}' has no GGUF file for '{tag}'{_files_hint(ref)}")
    if not files:
        raise HubError(
            f"'{ref}' holds no model the gateway loads: neither config.json with *.safetensors "
            "nor a .gguf file"
        )
    raise HubError(
        f"'{ref}' holds {len(files)} GGUF files; name one, e.g. "
        f"`mlx-gateway pull {RepoRef(ref.repo_id, ref.revision, files[0])}` "
        f"(files: {_some(files)})",
        exit_code=USAGE,
    )


def _some(files: list[str]) -> str:
    more = f", ... ({len(files) - _LISTED_FILES} more)" if len(files) > _LISTED_FILES else ""
    return ", ".join(files[:_LISTED_FILES]) + more


@contextlib.contextmanager
def _hub_errors(ref: RepoRef) -> Iterator[None]:
    """The Hub client's errors (several lines, URLs, advice for its own API) as one line
    that says what to change."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    login = "log in with `hf auth login` or set $HF_TOKEN"
    try:
        yield
    except GatedRepoError:
        raise HubError(
            f"'{ref.repo_id}' is gated: accept its terms on its Hub page, then {login}"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"no model repo '{ref.repo_id}' on {constants.ENDPOINT} (if it is private, {login})"
        ) from None
    except RevisionNotFoundError:
        raise HubError(
            f"'{ref.repo_id}' has no revision '{ref.revision}': give a branch, tag or commit "
            "that exists"
        ) from None
    except LocalEntryNotFoundError:
        raise HubError(
            f"cannot reach {constants.ENDPOINT} and '{ref}' is not in the cache "
            f"({constants.HF_HUB_CACHE}); check the network, $HF_ENDPOINT and $HF_HUB_OFFLINE"
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        raise HubError(f"the Hub answered {status} for '{ref}': {_first_line(exc)}") from None
    except OSError as exc:  # disk full, permissions, a size mismatch after retries
        raise HubError(f"downloading '{ref}' failed: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
