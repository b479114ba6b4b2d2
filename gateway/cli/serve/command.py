"""`mlx-gateway serve`: the models given by --model or --config, each loaded on demand
(the first at startup), behind one HTTP server; with --distributed, one model over the
ranks mlx.launch started (distributed.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from gateway.app import create_app
from gateway.cli.common import (
    DEFAULT_MODEL,
    bind_warning,
    check_bind,
    client_url,
    engine_settings,
    env,
)
from gateway.cli.errors import FAILED, CliError
from gateway.cli.serve import models as serve_models
from gateway.cli.serve.models import ModelConfig
from gateway.core.models import ModelRegistry, default_memory_budget
from gateway.core.settings import DEFAULT_MAX_TOKENS, EngineSettings, ServerSettings
from gateway.server import StartupFailed, run_server


def serve(args: argparse.Namespace) -> int:
    server = server_settings(args)
    check_bind(args.host, server.api_key, args.allow_unauthenticated)  # distributed too
    if args.engine_stall_seconds <= 0:
        raise CliError("--engine-stall-seconds must be above 0 (default 300)")
    stall = args.engine_stall_seconds
    settings = dataclasses.replace(
        engine_settings(args),
        stall_seconds=stall,
        allow_private_urls=args.allow_private_urls,
        quantize=args.quantize,
        quantize_group=args.quantize_group,
    )
    if args.distributed:  # one model over the ranks mlx.launch started
        # imported on use: a plain serve never loads runtime.distributed
        from gateway.cli.serve.distributed import serve_distributed

        return serve_distributed(args, settings, server, model_configs(args))
    registry = model_registry(args, settings)  # after the checks: it may download
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
    try:
        return run_server(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            grace=args.shutdown_grace,
        )
    except StartupFailed as exc:
        raise CliError(str(exc), FAILED) from None


def server_settings(args: argparse.Namespace) -> ServerSettings:
    origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    if args.max_connections < 0 or args.max_preparing < 1:
        raise CliError("--max-connections must be 0 or more, --max-preparing at least 1")
    try:
        return ServerSettings(
            api_key=args.api_key,
            host=args.host,
            allowed_hosts=hosts,
            max_connections=args.max_connections or None,  # 0: no bound
            max_preparing=args.max_preparing,
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
    given = args.model_alias if args.model_alias is not None else [env("MODEL_ALIAS", "")]
    return frozenset(n.strip() for item in given for n in item.split(",") if n.strip())


def model_configs(args: argparse.Namespace) -> list[ModelConfig]:
    """The models to serve: --config's, else each --model (else $MLX_GATEWAY_MODEL)."""
    aliases = model_aliases(args)  # for the default model, however the models are given
    config = args.config
    if config is None and not args.model and env("CONFIG", ""):
        config = Path(env("CONFIG", ""))
    if config is not None:
        if args.model or args.model_id:
            raise CliError("give the models with --config or with --model, not both")
        configs = serve_models.read_config(config)
        configs[0] = dataclasses.replace(configs[0], aliases=configs[0].aliases | aliases)
        return configs
    models = args.model or [env("MODEL", DEFAULT_MODEL)]
    return serve_models.from_flags(models, args.model_id, aliases)


def model_registry(args: argparse.Namespace, settings: EngineSettings) -> ModelRegistry:
    """The registry of the models to serve, each loaded on demand."""
    configs = model_configs(args)
    budget = args.memory_budget or default_memory_budget()
    specs = serve_models.model_specs(configs, settings, budget)
    try:
        return ModelRegistry(
            specs,
            keep_alive=args.keep_alive,
            memory_budget=budget,
            encoder_share=args.encoder_share,
        )
    except ValueError as exc:  # two models answering to one name
        raise CliError(str(exc)) from None
