"""Builds what the server serves from a model source: load, renderer, engine."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from gateway.served import ServedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    prefill_chunk: int = 2048
    max_queue: int = 64
    prefix_cache_bytes: int | None = None  # None = the runtime's default share of memory
    snapshot_interval: int = 1024


def build_served(
    path: Path,
    *,
    model_id: str,
    aliases: frozenset[str] = frozenset(),
    settings: EngineSettings | None = None,
    loaded: object | None = None,
) -> ServedModel:
    """Load `path` (or reuse an already `loaded` model) and wrap it for serving."""
    from runtime.engine import Engine
    from runtime.loader import LoadedModel, load
    from runtime.runner import ModelRunner, RunnerSettings
    from templates import TemplateError, renderer_for

    settings = settings or EngineSettings()
    model = loaded if isinstance(loaded, LoadedModel) else load(path)
    tok = model.tokenizer
    try:
        renderer = renderer_for(
            model.chat_template,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            model_type=str(model.config.get("model_type", "")),
        )
    except TemplateError as exc:
        log.warning("%s: %s; only raw completions will work", model_id, exc)
        renderer = None
    runner_settings = RunnerSettings(
        prefill_chunk=settings.prefill_chunk, snapshot_interval=settings.snapshot_interval
    )
    if settings.prefix_cache_bytes is not None:
        runner_settings = dataclasses.replace(
            runner_settings, prefix_cache_bytes=settings.prefix_cache_bytes
        )
    runner = ModelRunner(model, runner_settings)
    engine = Engine(runner, max_queue=settings.max_queue)
    return ServedModel(
        id=model_id, loaded=model, renderer=renderer, engine=engine, aliases=aliases, runner=runner
    )
