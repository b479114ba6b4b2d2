"""The CLI's errors: each ends the command with one line on stderr that says what to do.

Exit codes: 2 when the command line itself is wrong (a malformed or hostile name, a path
where a name belongs, a file that is not a model, a bad flag or setting), 1 when a
well-formed request could not be carried out (an unknown model, no network, the Hub has no
such repo, revision or file, a checksum mismatch), 130 on Ctrl-C.
"""

from __future__ import annotations

USAGE = 2
FAILED = 1


class CliError(SystemExit):
    """A bad flag or setting. A SystemExit, so that code calling the CLI's helpers outside
    `main` still stops; `main` prints `message` as one line and exits with `code`."""

    def __init__(self, message: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = code
        self.code = code  # what the interpreter exits with if nothing catches it


class StoreError(Exception):
    """Base of the model store's errors; the message says what to do."""

    exit_code = FAILED


class BadModelName(StoreError, ValueError):
    """A model name that is malformed or hostile: path traversal, control characters, an
    absolute path where only a name is accepted."""

    exit_code = USAGE
