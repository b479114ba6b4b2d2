"""`mlx-gateway launch CLIENT`: start a coding agent on the local model in one command.

    mlx-gateway launch claude|codex|openclaw|opencode [--model M] [--embedding-model E]
                       [--yes] [--config] [--restore] [--host H] [--port P] [--api-key K]
                       [-- CLIENT ARGS]

Uses the gateway serving at --host/--port, or starts one (and stops it when the client
exits); points the client at it through its environment or files of launch's own;
arguments after `--` go to the client unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TextIO

from gateway.cli.common import DEFAULT_MODEL
from gateway.cli.launch import flow
from gateway.cli.launch.base import Asker, Client, LaunchError
from gateway.cli.launch.binaries import find_client, missing_message
from gateway.cli.launch.claude import Claude
from gateway.cli.launch.codex import Codex
from gateway.cli.launch.openclaw import OpenClaw
from gateway.cli.launch.opencode import OpenCode
from gateway.cli.launch.server import Endpoint

__all__ = ["CLIENTS", "add_launch_parser", "run", "split_rest"]

CLIENTS: dict[str, Callable[[], Client]] = {
    "claude": Claude,
    "codex": Codex,
    "openclaw": OpenClaw,
    "opencode": OpenCode,
}

_EPILOG = """\
examples:
  mlx-gateway launch claude --model qwen2.5-coder-0.5b
  mlx-gateway launch claude --model qwen2.5-coder-0.5b --yes -- -p "say hi"
  mlx-gateway launch codex --port 8123 -- exec --skip-git-repo-check "say hi"
  mlx-gateway launch opencode -- run "say hi"
  mlx-gateway launch openclaw --yes -- agent --local --message "say hi"
  mlx-gateway launch openclaw --embedding-model all-minilm-l6-v2 --config
  mlx-gateway launch codex --restore
"""


def _env(name: str, default: str) -> str:
    return os.environ.get("MLX_GATEWAY_" + name) or default


def _options(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    def d(value: object) -> object:
        # The second parse (of options after CLIENT) must not reset what the first set.
        return value if defaults else argparse.SUPPRESS

    p.add_argument(
        "--model",
        default=d(None),
        help="model to serve when launch starts the gateway; a running gateway must serve "
        "it (default: whatever runs, else $MLX_GATEWAY_MODEL or smollm2-135m)",
    )
    p.add_argument(
        "--embedding-model",
        default=d(None),
        help="an embedding model for clients that embed (OpenClaw's memory search); "
        "launch's gateway serves it beside --model (default: the first one a running "
        "gateway serves, else none)",
    )
    p.add_argument("-y", "--yes", action="store_true", default=d(False), help="answer yes")
    p.add_argument(
        "--config", action="store_true", default=d(False), help="write the config, do not launch"
    )
    p.add_argument(
        "--restore", action="store_true", default=d(False), help="remove what launch wrote"
    )
    p.add_argument("--host", default=d(_env("HOST", "127.0.0.1")))
    p.add_argument("--port", type=int, default=d(int(_env("PORT", "8000"))))
    p.add_argument(
        "--api-key",
        default=d(os.environ.get("MLX_GATEWAY_API_KEY") or None),
        help="the gateway's key (also $MLX_GATEWAY_API_KEY)",
    )


def add_launch_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `launch` on the `mlx-gateway` command's subparsers."""
    p = sub.add_parser(
        "launch",
        help="start Claude Code, Codex, OpenClaw or opencode on the local model",
        usage="mlx-gateway launch {claude,codex,openclaw,opencode} [options] [-- CLIENT ARGS]",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("client", choices=sorted(CLIENTS))
    _options(p, defaults=True)
    # Everything after CLIENT: launch's own options, then `--` and the client's arguments.
    # argparse alone would either reject the client's options or swallow launch's.
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(launch_parser=p)  # for --help given after CLIENT


def split_rest(args: argparse.Namespace) -> None:
    """Parse launch's options given after CLIENT into `args`; the arguments after the
    first `--` become `args.client_args`, untouched."""
    rest = list(args.rest)
    cut = rest.index("--") if "--" in rest else len(rest)
    own, args.client_args = rest[:cut], rest[cut + 1 :]
    if "-h" in own or "--help" in own:
        args.launch_parser.print_help()
        raise SystemExit(0)
    p = argparse.ArgumentParser(prog=f"mlx-gateway launch {args.client}", add_help=False)
    _options(p, defaults=False)
    _, extra = p.parse_known_args(own, namespace=args)
    if extra:
        raise LaunchError(
            f"unexpected {' '.join(extra)!r}: put the client's own arguments after `--`, "
            f"as in: mlx-gateway launch {args.client} -- {' '.join(extra)}"
        )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """The `launch` command; returns the client's exit status (1 for launch's errors)."""
    out = out or sys.stderr
    try:
        return _run(args, out)
    except LaunchError as exc:
        out.write(f"mlx-gateway launch: {exc}\n")
        return 1
    except KeyboardInterrupt:  # while the gateway started (the client owns Ctrl-C later)
        out.write("\nmlx-gateway launch: interrupted\n")
        return 130


def _run(args: argparse.Namespace, out: TextIO) -> int:
    if not hasattr(args, "client_args"):
        split_rest(args)
    client = CLIENTS[args.client]()
    if args.restore:
        if args.model or args.embedding_model or args.config or args.client_args:
            raise LaunchError(
                "--restore takes no --model, --embedding-model, --config or client arguments"
            )
        client.restore(out)
        return 0
    why = client.conflict(args.client_args)
    if why:
        raise LaunchError(f"refused: {why}")
    exe = None
    if not args.config:
        exe = find_client(client)
        if exe is None:
            raise LaunchError(missing_message(client))
        client.preflight(exe)
    asker = Asker(yes=args.yes)
    endpoint = Endpoint(args.host, args.port, args.api_key)
    default_model = _env("MODEL", DEFAULT_MODEL)
    embedding = args.embedding_model
    with flow.gateway(endpoint, args.model, default_model, out, embedding) as (served, started):
        target = flow.make_target(endpoint, served, embedding)
        action = f"Write the {client.title} config" if exe is None else f"Start {client.title}"
        flow.check_context(client, served, started, asker, out, action)
        flow.write_files(client, target, asker, out)
        if exe is None:
            line = flow.manual(client, exe, target)
            out.write(f"configured; start {client.title} with:\n  {line}\n")
            if started:
                models = [args.model or default_model, *([embedding] if embedding else [])]
                out.write(
                    f"with a gateway serving at {endpoint.root_url}, as `mlx-gateway serve "
                    f"{' '.join('--model ' + m for m in models)} --port {endpoint.port}` (the "
                    "one launch started to read the model's context stops now)\n"
                )
            return 0
        return flow.run_client(client, exe, target, args.client_args, out)
