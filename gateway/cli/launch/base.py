"""What every client integration shares: the served model it is pointed at, the files and
the command it needs, and the questions launch may have to ask."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TextIO

# Clients insist on some key; a gateway started without --api-key accepts any.
PLACEHOLDER_KEY = "mlx-gateway"
PROVIDER_ID = "mlx-gateway"  # the provider / profile name launch registers in each client
KEY_ENV = "MLX_GATEWAY_API_KEY"  # where launch hands the key to clients that read it from env
# Room a session needs beyond the client's first request: the reply, tool results and a
# few turns. Below prompt + ROOM, requests soon fail with context_length_exceeded.
ROOM = 4096


class LaunchError(Exception):
    """A message for the user; launch prints it and exits with status 1."""


@dataclass(frozen=True)
class Target:
    """The served model a client is pointed at, as GET /v1/models describes it."""

    root_url: str  # http://127.0.0.1:8000, no trailing slash and no /v1
    model: str
    context_length: int | None
    max_output: int  # the reply budget launch tells clients that ask for one
    api_key: str | None = None
    vision: bool = False
    thinking: bool = False
    embedding_model: str | None = None  # served for /v1/embeddings, when one is

    @property
    def v1_url(self) -> str:
        return self.root_url + "/v1"

    @property
    def key(self) -> str:
        return self.api_key or PLACEHOLDER_KEY


@dataclass(frozen=True)
class PlannedFile:
    """A file a client needs, with the exact bytes; `confirm` is a question to ask
    first (for a file the user also edits by hand), None to just write it."""

    path: Path
    data: bytes
    confirm: str | None = None
    mode: int = 0o644


@dataclass(frozen=True)
class Invocation:
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class EnvPlan:
    """How launch changes the client's environment: `forced` values always win (they
    route the client to the gateway); `defaults` apply only where the user set nothing
    (tuning the user may know better); `removed` names are dropped (they would send
    the client elsewhere)."""

    forced: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, str] = field(default_factory=dict)
    removed: tuple[str, ...] = ()

    def apply(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in self.removed}
        for key, value in self.defaults.items():
            env.setdefault(key, value)
        env.update(self.forced)
        return env


class Client(ABC):
    """One coding agent launch knows how to point at the gateway."""

    name: ClassVar[str]  # the word on the command line
    title: ClassVar[str]
    binary: ClassVar[str]
    install: ClassVar[str]  # the exact command that installs it
    # Tokens in the client's first request (system prompt + tools), measured on the
    # captured requests in shared/fixtures/clients with the Qwen3 tokenizer.
    prompt_tokens: ClassVar[int]
    extra_dirs: ClassVar[tuple[str, ...]] = ()  # home-relative install dirs off PATH

    def conflict(self, args: Sequence[str]) -> str | None:
        """Why a passthrough argument would fight launch's settings, or None."""
        return None

    def preflight(self, exe: Path) -> None:
        """Checks that need the executable (a runtime it depends on), before any server
        starts; raises LaunchError. Most clients need none."""
        return None

    def files(self, target: Target) -> list[PlannedFile]:
        return []

    def notes(self, target: Target) -> list[str]:
        """Lines launch prints before writing the files (what it set up, or left)."""
        return []

    @abstractmethod
    def invocation(
        self, exe: Path, target: Target, args: Sequence[str], base_env: Mapping[str, str]
    ) -> Invocation: ...

    def restore(self, out: TextIO) -> None:
        out.write(f"launch {self.name} writes no files (only environment): nothing to restore\n")

    def manual(self, exe: Path, target: Target) -> str:
        """How to start the client by hand with what --config wrote."""
        inv = self.invocation(exe, target, [], {})
        return shell_line(inv.argv, inv.env)


def shell_line(argv: Sequence[str], env: Mapping[str, str]) -> str:
    import shlex

    parts = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    return " ".join([*parts, *(shlex.quote(a) for a in argv)])


def option_conflict(
    args: Sequence[str], longs: Iterable[str], shorts: Iterable[str] = ()
) -> str | None:
    """The first argument that sets one of these options (`--model x`, `--model=x`,
    `-m x`, `-mx`); scanning stops at a bare `--`, after which all is positional."""
    longs, shorts = tuple(longs), tuple(shorts)
    for arg in args:
        if arg == "--":
            return None
        if any(arg == o or arg.startswith(o + "=") for o in longs):
            return arg
        if any(arg == o or (arg.startswith(o) and len(arg) > len(o)) for o in shorts):
            return arg
    return None


class Asker:
    """Asks yes/no questions, or answers them: `--yes` says yes to all; without a
    terminal and without `--yes`, a question is an error rather than a hang."""

    def __init__(
        self,
        *,
        yes: bool,
        interactive: bool | None = None,
        out: TextIO | None = None,
        read: Callable[[str], str] = input,
    ) -> None:
        self.yes = yes
        self.interactive = sys.stdin.isatty() if interactive is None else interactive
        self.out = out or sys.stderr
        self._read = read

    def confirm(self, question: str) -> bool:
        if self.yes:
            self.out.write(f"{question} yes (--yes)\n")
            return True
        if not self.interactive:
            raise LaunchError(
                f"{question}\nlaunch needs an answer and there is no terminal to ask on: "
                "run it again with --yes to answer yes."
            )
        self.out.flush()
        try:
            answer = self._read(f"{question} [y/N] ")
        except EOFError:
            answer = ""
        return answer.strip().lower() in ("y", "yes")
