"""`mlx-gateway serve --distributed tensor|pipeline`: one model over the processes that
`mlx.launch` started, on one host or several (a hostfile or --hosts; any backend MLX
has: ring over Ethernet or Thunderbolt, JACCL, MPI, NCCL on CUDA).

Every rank runs the same command line. Each joins the group, loads its part of the
model (runtime/distributed/load.py; from a shared path or its own copy) and then:

- rank 0 serves HTTP with the templates, the parsers and the engine, whose runner leads
  the group (runtime/distributed/lockstep.py);
- every other rank follows rank 0's steps (runtime/distributed/follower.py): no HTTP,
  nothing bound. It leaves when rank 0 ends the group; a first SIGINT/SIGTERM waits for
  that (rank 0 drains, then stops everyone), a second leaves at once.

A group serves one model, loaded at startup and never unloaded (--keep-alive does not
apply): several --model, or a --config listing several, is an error. The runner
settings (--max-batch, --prefill-chunk, the cache budgets) are rank 0's; the prefix
cache's disk tier is not available. When the group loses a rank, rank 0's engine stops
for good: requests get 503s that say why, so does /health, and the process stays up
until it is stopped. It stays up past mlx.launch's SIGTERM too (the launcher sends one
to every rank once a rank exits with an error), logging to a file from then on: a
SIGINT or a second SIGTERM ends it (gateway/cli/serve/distributed_stop.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from gateway.app import create_app
from gateway.cli.common import bind_warning, client_url, resolve
from gateway.cli.errors import FAILED, CliError
from gateway.cli.serve import models as serve_models
from gateway.cli.serve.distributed_stop import GroupServer, leave
from gateway.cli.serve.models import ModelConfig
from gateway.core.models import (
    ModelRegistry,
    ServedModel,
    build_served,
    default_memory_budget,
    weight_quantization,
)
from gateway.core.settings import EngineSettings, ServerSettings
from gateway.server import StartupFailed, run_server
from runtime.distributed import Channel, Group, LockstepRunner, follow, load_sharded
from runtime.load import LoadedModel, QuantizeSpec

log = logging.getLogger(__name__)

_CLOSE_SLACK_S = 30  # beyond its own bounds, what a shutdown may take before the alarm


def serve_distributed(
    args: argparse.Namespace,
    settings: EngineSettings,
    server: ServerSettings,
    configs: Sequence[ModelConfig],
) -> int:
    """This rank's part of the distributed server; the process ends here (os._exit:
    an MLX call that a lost peer left blocked cannot be waited for)."""
    cfg = _one_model(args, configs)
    if args.distributed_timeout <= 0:
        raise CliError("--distributed-timeout must be above 0")
    serve_models.check_names([cfg])
    group = _join(args.distributed_backend)
    _tag_logs(group.rank)
    log.info(
        "joined the group: %s, %s parallel (pid %d)",
        group.describe(),
        args.distributed,
        os.getpid(),
    )
    path, default_id = resolve(cfg.source)
    quantize = settings.quantize if cfg.quantize == "default" else cfg.quantize
    own = dataclasses.replace(
        settings, quantize=quantize, quantize_group=cfg.quantize_group or settings.quantize_group
    )
    loaded = _load(path, group, args.distributed, cfg, weight_quantization(own))
    channel = Channel(group.handle)
    if group.rank == 0:
        code = _lead(args, settings, server, cfg, path, cfg.id or default_id, loaded, channel)
    else:
        code = _follow(args, settings, loaded, channel)
    leave(code)


def _one_model(args: argparse.Namespace, configs: Sequence[ModelConfig]) -> ModelConfig:
    if len(configs) != 1:
        raise CliError(
            f"--distributed serves one model; {len(configs)} were given (--model or "
            "--config): start one distributed server per model"
        )
    if args.prefix_cache_dir is not None:
        raise CliError(
            "--prefix-cache-dir is not available with --distributed (each rank would keep "
            "files of its own shard); leave it out"
        )
    return configs[0]


def _join(backend: str) -> Group:
    try:
        group = Group.init(backend, strict=True)
    except (RuntimeError, ValueError) as exc:
        raise CliError(str(exc), FAILED) from None
    if group.size < 2:
        raise CliError(
            "--distributed needs at least two ranks: start this command on every host "
            "with mlx.launch (e.g. mlx.launch --hostfile hosts.json -- mlx-gateway serve "
            "--distributed tensor ...)",
            FAILED,
        )
    return group


def _tag_logs(rank: int) -> None:
    """mlx.launch interleaves every rank's output: say whose each line is."""
    fmt = f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(fmt))


def _load(
    path: Path, group: Group, mode: str, cfg: ModelConfig, quantize: QuantizeSpec | None
) -> LoadedModel:
    try:
        loaded = load_sharded(path, group, mode, quantize=quantize)  # type: ignore[arg-type]
    except ValueError as exc:  # cannot be split so (the message says which sizes work)
        raise CliError(str(exc), FAILED) from None
    if cfg.context_length is not None:
        loaded = dataclasses.replace(loaded, context_length=cfg.context_length)
    return loaded


def _lead(
    args: argparse.Namespace,
    settings: EngineSettings,
    server: ServerSettings,
    cfg: ModelConfig,
    path: Path,
    model_id: str,
    loaded: LoadedModel,
    channel: Channel,
) -> int:
    """Rank 0: the HTTP server, its engine leading the group."""

    def make_runner(model: LoadedModel, runner_settings: Any) -> LockstepRunner:
        return LockstepRunner(
            model,
            runner_settings,
            channel,
            timeout=args.distributed_timeout,
            slow_bound=settings.stall_seconds,
        )

    own = dataclasses.replace(
        settings,
        template_family=cfg.template_family or settings.template_family,
        parser=cfg.parser or settings.parser,
        memory_budget=args.memory_budget or default_memory_budget(),
        kv_bits=settings.kv_bits if cfg.kv_bits == "default" else cfg.kv_bits,
    )
    served = build_served(
        path, model_id=model_id, aliases=cfg.aliases, settings=own, loaded=loaded,
        make_runner=make_runner,
    )  # fmt: skip
    runner = served.runner
    assert isinstance(runner, LockstepRunner)

    def lost(why: str) -> None:  # every request a 503, for good
        served.engine.halt(f"{why}; restart the group with mlx.launch")

    runner.on_lost = lost
    served.caps = dataclasses.replace(served.caps, vision=False)  # text only, for now
    if cfg.sampling:
        served.sampling_defaults = {**served.sampling_defaults, **cfg.sampling}
    registry = _group_registry(served, runner)  # starts the engine
    runner.watch()
    app = create_app(registry, server)
    warning = bind_warning(args.host, server.api_key)
    if warning:
        print(warning, file=sys.stderr)
    url = client_url(args.host, args.port)
    size = channel.size
    print(
        f"mlx-gateway: serving {model_id} over {size} ranks ({args.distributed} parallel) "
        f"at {url}  (OPENAI_BASE_URL={url})",
        file=sys.stderr,
    )
    try:
        code = run_server(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            grace=args.shutdown_grace,
            server=lambda config, app, grace: GroupServer(config, app, grace, runner),
        )
    except BaseException as exc:
        runner.shutdown(f"rank 0's server failed: {type(exc).__name__}: {exc}")
        if isinstance(exc, StartupFailed):
            raise CliError(str(exc), FAILED) from None
        raise
    runner.shutdown()
    if runner.lost is not None:
        log.error("the distributed group was lost: %s", runner.lost)
        return FAILED
    return code


def _group_registry(served: ServedModel, runner: LockstepRunner) -> ModelRegistry:
    """The one model's registry (it never unloads), whose close at shutdown leaves the
    process instead when the group was lost: the worker's collective is blocked for
    good, and freeing MLX memory would wait on it, holding the interpreter's lock. By
    then the drain has answered every client."""

    class GroupRegistry(ModelRegistry):
        def close(self, timeout: float = 30.0) -> None:
            if runner.lost is None:
                # a backstop: a rank lost during this close leaves it stuck the same way
                signal.alarm(int(timeout + runner.timeout) + _CLOSE_SLACK_S)
                super().close(timeout)
                signal.alarm(0)
            if runner.lost is not None:
                log.error("leaving: the distributed group was lost (%s)", runner.lost)
                leave(FAILED)

    return GroupRegistry.serving(served, lambda: served)


def _follow(
    args: argparse.Namespace, settings: EngineSettings, loaded: LoadedModel, channel: Channel
) -> int:
    """Every other rank: follow rank 0 until it ends the group."""
    _patient_signals()
    return follow(
        loaded, channel, timeout=args.distributed_timeout, slow_bound=settings.stall_seconds
    )


def _patient_signals() -> None:
    """A follower's first SIGINT/SIGTERM waits for rank 0 (which drains, then ends the
    group); a second leaves at once."""
    heard: list[int] = []

    def handle(sig: int, frame: FrameType | None) -> None:
        if heard:
            sys.stderr.write(f"mlx-gateway: second {signal.Signals(sig).name}: leaving now\n")
            sys.stderr.flush()
            os._exit(128 + sig)
        heard.append(sig)
        log.warning(
            "%s: waiting for rank 0 to end the group (a second signal leaves now)",
            signal.Signals(sig).name,
        )

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
