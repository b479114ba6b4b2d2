"""The `mlx-gateway` command: serve, pull, list, run, launch, ps, show, rm. This module only
dispatches: the options are in args.py, what commands share in common.py, and each
command in its own module (serve/, store/, chat.py, launch/, ps.py, show.py, rm.py).

Every error ends the command with one line on stderr that says what to change, and exit
code 2 for a wrong command line, 1 for a failed operation (gateway/cli/errors.py); an
unforeseen exception is one line too, its traceback logged at --log-level debug.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from gateway.cli.args import build_parser
from gateway.cli.errors import FAILED, CliError, StoreError
from gateway.cli.launch import run as run_launch
from gateway.cli.ps import ps
from gateway.cli.rm import rm
from gateway.cli.store.commands import list_models, pull
from runtime import backend

INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except CliError as exc:
        return _fail(exc.message, exc.exit_code)
    except StoreError as exc:
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", INTERRUPTED)
    except Exception as exc:  # unforeseen: still one line; the traceback is for --log-level debug
        logging.getLogger("mlx-gateway").debug("unexpected error", exc_info=True)
        return _fail(f"{type(exc).__name__}: {exc}", FAILED, unexpected=True)


def _fail(message: str, code: int, *, unexpected: bool = False) -> int:
    first, *rest = message.strip().splitlines() or [""]
    for line in rest:  # e.g. pip's own output after a failed download
        logging.getLogger("mlx-gateway").debug("%s", line)
    if rest or unexpected:
        first += " (run with --log-level debug for details)"
    print(f"mlx-gateway: error: {first}", file=sys.stderr)
    return code


def _configure_logging(level_name: str) -> None:
    level = logging.getLevelName(level_name.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:
        # HTTP clients (the Hub client's among them) log every request at INFO
        for name in ("httpx", "httpx2", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level)
    if args.command == "launch":  # runs a client; this process loads no model
        return run_launch(args)
    if args.command == "pull":  # neither pulls nor lists load MLX
        return pull(args)
    if args.command == "list":
        return list_models(args)
    if args.command == "ps":  # asks a running server; loads nothing
        return ps(args)
    if args.command == "rm":
        return rm(args)
    backend.configure()  # before anything imports mlx
    if args.command == "serve":
        # imported after backend.configure(): serving imports MLX (and the whole app)
        from gateway.cli.serve.command import serve

        return serve(args)
    if args.command == "show":
        # imported after backend.configure(): it reads GGUF metadata with runtime.load
        from gateway.cli.show import show

        return show(args)
    # imported after backend.configure(): the chat builds a model, which imports MLX
    from gateway.cli.chat import run as run_chat

    return run_chat(args)


if __name__ == "__main__":
    raise SystemExit(main())
