"""The `mlx-gateway` command: serve, pull, list, run.

Every error ends the command with one line on stderr that says what to change, and exit
code 2 for a wrong command line, 1 for a failed operation (gateway/cli/errors.py); an
unforeseen exception is one line too, its traceback logged at --log-level debug.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gateway.cli.errors import FAILED, CliError, StoreError
from gateway.core.models.build import EngineSettings
from gateway.core.settings import (
    API_KEY_ENV,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS,
    ServerSettings,
)

if TYPE_CHECKING:
    from gateway.cli.serve.models import ModelConfig
    from gateway.core.models.registry import ModelRegistry

DEFAULT_MODEL = "smollm2-135m"
ENV_PREFIX = "MLX_GATEWAY_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
INTERRUPTED = 130
MODEL_HELP = "alias, path, or Hugging Face repo id: org/name[@revision][:file.gguf]"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def connectable_host(host: str) -> str:
    """The address a client on this machine should dial for a bind address: an
    unspecified one (0.0.0.0, ::) becomes the loopback of its family, IPv6 gets brackets."""
    if host in ("", "*"):
        return "127.0.0.1"
    ip = _ip(host)
    if ip is None:
        return host  # a host name
    if ip.is_unspecified:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    return f"[{ip}]" if ip.version == 6 else str(ip)


def is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" if ip is None else ip.is_loopback


def client_url(host: str, port: int) -> str:
    """The base URL to print for clients: always one they can connect to."""
    return f"http://{connectable_host(host)}:{port}/v1"


def bind_warning(host: str, api_key: str | None) -> str | None:
    if api_key is not None or is_loopback(host):
        return None
    return (
        f"mlx-gateway: WARNING: listening on {host} without an API key: anyone who can "
        f"reach this machine can use the model. Set --api-key or ${API_KEY_ENV}."
    )


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(ENV_PREFIX + name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise CliError(f"${ENV_PREFIX}{name} must be a whole number, not {value!r}") from None


def _env_bytes(name: str, default: int | None) -> int | None:
    value = os.environ.get(ENV_PREFIX + name, "").strip()
    if not value:
        return default
    try:
        return parse_bytes(value)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"${ENV_PREFIX}{name}: {exc}") from None


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line (the usage is in --help)."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)")


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"not a log level: {text!r} (one of {', '.join(LOG_LEVELS)})"
        )
    return text.lower()


def _parser() -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = _Parser(
        prog="mlx-gateway", description="Local LLM API server on MLX"
    )
    p.add_argument("--log-level", type=_log_level, default=_env("LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model over the OpenAI API")
    s.add_argument(
        "--model",
        action="append",
        default=None,
        help=MODEL_HELP + "; repeatable: several models, loaded on demand, the first the "
        f"default (default: $MLX_GATEWAY_MODEL, else {DEFAULT_MODEL})",
    )
    s.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    s.add_argument("--port", type=int, default=_env_int("PORT", 8000))
    s.add_argument(
        "--model-id", default=None, help="name clients use (default: alias or file name)"
    )
    s.add_argument(
        "--model-alias",
        action="append",
        default=None,
        metavar="NAME",
        help="another model name to answer to (repeatable; e.g. the names Claude Code asks "
        "for; default: $MLX_GATEWAY_MODEL_ALIAS, comma-separated)",
    )
    _models_args(s)
    _engine_args(s)
    _server_args(s)
    from gateway.cli.serve.distributed import add_distributed_args

    add_distributed_args(s)

    pull = sub.add_parser(
        "pull", help="download a model (an alias, or a Hugging Face repo into the Hub cache)"
    )
    pull.add_argument(
        "model", help="alias, or Hugging Face repo id: org/name[@revision][:file.gguf]"
    )
    sub.add_parser("list", help="list known and downloaded models")

    r = sub.add_parser("run", help="chat with a model in the terminal")
    r.add_argument("model", nargs="?", default=_env("MODEL", DEFAULT_MODEL), help=MODEL_HELP)
    r.add_argument("prompt", nargs="?", default=None, help="one prompt, then exit")
    r.add_argument("--max-tokens", type=int, default=512)
    r.add_argument("--temperature", type=float, default=0.7)
    r.add_argument("--system", default=None, help="system message")
    _engine_args(r)

    from gateway.cli.launch import add_launch_parser

    add_launch_parser(sub)
    return p


def parse_bytes(text: str) -> int:
    """'0', '512M', '4G', '1.5GiB' -> bytes."""
    units = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = s[-1] if s and s[-1] in "kmgt" else ""
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 0, 512M, 4G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError("a size cannot be negative")
    return int(value * units[unit])


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=int, default=_env_int("PREFILL_CHUNK", 2048))
    p.add_argument("--max-queue", type=int, default=_env_int("MAX_QUEUE", 64))
    p.add_argument(
        "--max-batch",
        type=int,
        default=_env_int("MAX_BATCH", 8),
        help="sequences decoding together in one batched step (1 turns batching off)",
    )
    p.add_argument(
        "--prefix-cache-bytes",
        type=parse_bytes,
        default=_env_bytes("PREFIX_CACHE_BYTES", None),
        help="memory for paged-out conversation state (0 turns the prefix cache off; "
        "default: a fifth of RAM)",
    )
    p.add_argument(
        "--prefix-cache-dir",
        type=Path,
        default=_env("PREFIX_CACHE_DIR", "") or None,
        help="keep conversation state evicted from memory (and all of it at shutdown) on "
        "disk here, one folder per model, so it survives restarts "
        "(e.g. ~/.cache/mlx-gateway/prefix; default: no disk tier)",
    )
    p.add_argument(
        "--prefix-cache-disk-bytes",
        type=parse_bytes,
        default=_env_bytes("PREFIX_CACHE_DISK_BYTES", None),
        help="most disk each model's prefix-cache folder may take; the least recently "
        "used state goes first (default 8G)",
    )
    p.add_argument(
        "--snapshot-interval",
        type=int,
        default=_env_int("SNAPSHOT_INTERVAL", 1024),
        help="tokens between restore points inside long prompts",
    )
    p.add_argument(
        "--template-family",
        default=_env("TEMPLATE_FAMILY", "") or None,
        help="render chats with this built-in template instead of the model's own "
        "(qwen3, qwen3-coder, qwen3.5, glm-4.7, gemma3, deepseek-v3.1, llama3, ...)",
    )
    p.add_argument(
        "--parser",
        default=_env("PARSER", "") or None,
        help="read model output with this parser instead of the detected one "
        "(hermes, qwen3-coder, glm-4.7, deepseek-v3.1, llama3-json, think, passthrough)",
    )


def _models_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="the models to serve, in a TOML file of [[models]] tables (source, id, aliases, "
        "template_family, parser, context_length, sampling); instead of --model (default: "
        "$MLX_GATEWAY_CONFIG when no --model is given)",
    )
    p.add_argument(
        "--keep-alive",
        type=_seconds,
        default=_env("KEEP_ALIVE", "1800"),
        help="unload a model idle this many seconds; the next request loads it again "
        "(default 1800; 0 = never)",
    )
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=_env_bytes("MEMORY_BUDGET", None),
        help="memory for loaded models' weights and caches (each model's running batch "
        "and prefix cache share what its weights leave; with several models at most a "
        "quarter of RAM each): a model that would not fit first unloads the least recently "
        "used idle ones (default: three quarters of RAM)",
    )


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-private-urls",
        action="store_true",
        default=_env("ALLOW_PRIVATE_URLS", "").lower() in ("1", "true", "yes", "on"),
        help="fetch image URLs on loopback, private and link-local hosts too (default: "
        "public hosts only, so a request cannot make the server reach its own network)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require this key on every route but /health (also ${API_KEY_ENV})",
    )
    p.add_argument(
        "--cors-origins",
        default=_env("CORS_ORIGINS", ""),
        help="comma-separated browser origins allowed to call the API ('*' = any; default none)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=_env_bytes("MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
        help="largest request body accepted (413 above it; default 32M)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=_env_int("MAX_PROMPT_TOKENS", None),
        help="longest prompt accepted, in tokens (default: the model's context)",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=_env_int("MAX_TOKENS_CAP", None),
        help="largest max_tokens a request may ask for (default: what the context leaves)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=_env_int("DEFAULT_MAX_TOKENS", None),
        help=f"output bound of a request that sets none (default {DEFAULT_MAX_TOKENS}; "
        "0 = what the context leaves)",
    )
    p.add_argument(
        "--strict-max-tokens",
        action="store_true",
        default=_env("STRICT_MAX_TOKENS", "").lower() in ("1", "true", "yes", "on"),
        help="refuse a max_tokens beyond the context's room or --max-tokens-cap with a 400, "
        "as OpenAI does (default: clamp it)",
    )
    p.add_argument(
        "--engine-stall-seconds",
        type=_seconds,
        default=_env("ENGINE_STALL_SECONDS", "300"),
        help="fail the running requests (503) and restart the engine's worker when it makes "
        "no step this long while it has work (default 300: a CPU prefill chunk can be slow)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=_env("SHUTDOWN_GRACE", "30"),
        help="on SIGTERM/SIGINT, seconds the running generations get to finish before they "
        "are cancelled; new ones get 503 meanwhile, a second signal exits at once (default 30)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError("seconds cannot be negative")
    return value


def server_settings(args: argparse.Namespace) -> ServerSettings:
    origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    try:
        return ServerSettings(
            api_key=args.api_key,
            cors_origins=origins,
            max_body_bytes=args.max_body_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens_cap=args.max_tokens_cap,
            default_max_tokens=_default_max_tokens(args.default_max_tokens),
            strict_max_tokens=args.strict_max_tokens,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _default_max_tokens(value: int | None) -> int | None:
    if value is None:
        return DEFAULT_MAX_TOKENS
    return None if value == 0 else value  # 0: no bound but the context


def model_aliases(args: argparse.Namespace) -> frozenset[str]:
    """--model-alias values (commas split them too), else $MLX_GATEWAY_MODEL_ALIAS."""
    given = args.model_alias if args.model_alias is not None else [_env("MODEL_ALIAS", "")]
    return frozenset(n.strip() for item in given for n in item.split(",") if n.strip())


def _engine_settings(args: argparse.Namespace) -> EngineSettings:
    import parsers
    import templates

    if args.parser and args.parser not in parsers.names():
        raise CliError(f"unknown --parser {args.parser!r}; known: {', '.join(parsers.names())}")
    families = sorted(templates.builtin_families())
    if args.template_family and args.template_family not in families:
        raise CliError(
            f"unknown --template-family {args.template_family!r}; known: {', '.join(families)}"
        )
    return EngineSettings(
        prefill_chunk=args.prefill_chunk,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        prefix_cache_bytes=args.prefix_cache_bytes,
        prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk_bytes=args.prefix_cache_disk_bytes,
        snapshot_interval=args.snapshot_interval,
        template_family=args.template_family,
        parser=args.parser,
    )


def _resolve(name: str) -> tuple[Path, str]:
    """The model's path and the id clients see: an alias or repo id as given, else the
    file or folder name."""
    from gateway.cli.launch.server import requested_id
    from gateway.cli.store.store import Store

    return Store().resolve(name), requested_id(name)


def _serve(args: argparse.Namespace) -> int:
    import dataclasses

    from gateway.app import create_app
    from gateway.server.run import run_server

    server = server_settings(args)
    if args.engine_stall_seconds <= 0:
        raise CliError("--engine-stall-seconds must be above 0 (default 300)")
    stall = args.engine_stall_seconds
    settings = dataclasses.replace(
        _engine_settings(args), stall_seconds=stall, allow_private_urls=args.allow_private_urls
    )
    if args.distributed:  # one model over the ranks mlx.launch started
        from gateway.cli.serve.distributed import serve_distributed

        return serve_distributed(args, settings, server, _model_configs(args), _resolve)
    registry = _registry(args, settings)  # after the checks: it may download
    app = create_app(registry, server)
    warning = bind_warning(args.host, server.api_key)
    if warning:
        print(warning, file=sys.stderr)
    url = client_url(args.host, args.port)
    default, *others = registry.specs
    print(f"mlx-gateway: serving {default.id} at {url}  (OPENAI_BASE_URL={url})", file=sys.stderr)
    if default.aliases:
        print(f"mlx-gateway: also answering to {', '.join(default.names[1:])}", file=sys.stderr)
    for spec in others:
        names = ", ".join(spec.names)
        print(f"mlx-gateway: and, loaded on first use, {names}", file=sys.stderr)
    return run_server(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        grace=args.shutdown_grace,
    )


def _model_configs(args: argparse.Namespace) -> list[ModelConfig]:
    """The models to serve: --config's, else each --model (else $MLX_GATEWAY_MODEL)."""
    import dataclasses

    from gateway.cli.serve import models as serve_models

    aliases = model_aliases(args)  # for the default model, however the models are given
    config = args.config
    if config is None and not args.model and _env("CONFIG", ""):
        config = Path(_env("CONFIG", ""))
    if config is not None:
        if args.model or args.model_id:
            raise CliError("give the models with --config or with --model, not both")
        configs = serve_models.read_config(config)
        configs[0] = dataclasses.replace(configs[0], aliases=configs[0].aliases | aliases)
        return configs
    models = args.model or [_env("MODEL", DEFAULT_MODEL)]
    return serve_models.from_flags(models, args.model_id, aliases)


def _registry(args: argparse.Namespace, settings: EngineSettings) -> ModelRegistry:
    """The registry of the models to serve, each loaded on demand."""
    from gateway.cli.serve import models as serve_models
    from gateway.core.models.memory import default_memory_budget
    from gateway.core.models.registry import ModelRegistry

    configs = _model_configs(args)
    budget = args.memory_budget or default_memory_budget()
    specs = serve_models.model_specs(configs, settings, _resolve, budget)
    try:
        return ModelRegistry(specs, keep_alive=args.keep_alive, memory_budget=budget)
    except ValueError as exc:  # two models answering to one name
        raise CliError(str(exc)) from None


def _pull(args: argparse.Namespace) -> int:
    from gateway.cli.store.store import Store

    print(Store().pull_name(args.model))
    return 0


def _list(_: argparse.Namespace) -> int:
    from gateway.cli.store.store import Store

    for item in Store().list():
        mark = "*" if item.present else " "
        size = f"{item.size / 1e6:8.1f} MB" if item.size else " " * 11
        print(f"{mark} {item.alias:<22} {size}  {item.path}")
    print("(* = downloaded)")
    return 0


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
    args = _parser().parse_args(argv)
    _configure_logging(args.log_level)
    if args.command == "launch":  # runs a client; this process loads no model
        from gateway.cli.launch import run as run_launch

        return run_launch(args)
    if args.command == "pull":  # neither pulls nor lists load MLX
        return _pull(args)
    if args.command == "list":
        return _list(args)
    from runtime import backend

    backend.configure()  # before anything imports mlx
    if args.command == "serve":
        return _serve(args)
    from gateway.cli.chat import run_chat

    settings = _engine_settings(args)
    path, model_id = _resolve(args.model)
    return run_chat(path, model_id, args, settings)


if __name__ == "__main__":
    raise SystemExit(main())
