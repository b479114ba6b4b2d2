"""The models `mlx-gateway serve` is given: `--model` (repeatable) or a TOML file
(`--config`), each turned into a registry entry that loads on demand.

A config file lists `[[models]]` tables:

    [[models]]
    source = "qwen2.5-coder-0.5b"      # alias, path or Hugging Face id, as --model takes
    id = "coder"                       # the name clients use (default: as --model names it)
    aliases = ["gpt-4o-mini"]          # more names it answers to
    template_family = "qwen2.5"        # a built-in renderer instead of its own template
    parser = "hermes"                  # an output parser instead of the detected one
    context_length = 16384             # tokens (default: the model's own)
    kv_bits = 8                        # KV cache in 8 or 4 bits, or "none" (default: --kv-bits)
    quantize = "q4"                    # a float model quantized at load: q4, q8 or "none"
    quantize_group = 64                # 32, 64 or 128 (default: --quantize, --quantize-group)
    sampling = { temperature = 0.2 }   # defaults for fields a request leaves out
    draft_model = "qwen2.5-0.5b"       # a small model with its tokenizer drafts for it
                                       # (--speculative draft for this model; default:
                                       # --draft-model, given one model only)
    matryoshka_dimensions = [256, 128] # an embedding model's Matryoshka sizes: the
                                       # `dimensions` /v1/embeddings accepts (default: none)
    task = "rerank"                    # "generate", "embed" or "rerank": what a Qwen3
                                       # decoder serves where its files leave it open (a
                                       # Qwen3-Reranker not named "...reranker"); default:
                                       # detected (runtime/load/decoder_encoder.py)

The first model is the default (for requests that name none). A relative path is read
from the file's folder. Every problem in the file is one CliError naming the file, the
model and the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import parsers
import templates
from gateway.cli.common import parse_kv_bits, parse_quantize, resolve
from gateway.cli.errors import CliError
from gateway.core.models import (
    SAMPLING_FIELDS,
    ModelSpec,
    ServedModel,
    build_encoder_served,
    build_served,
    cache_budget,
    check_dimensions,
    check_draft_tokenizer,
    quantized_estimate,
    weight_file_bytes,
    weight_quantization,
)
from gateway.core.settings import QUANTIZE_GROUPS, EngineSettings
from runtime.load import (
    MODEL_TASKS,
    EncoderTask,
    check_quantize,
    encoder_task,
    load,
    load_encoder,
)
from runtime.models import mtp_layers

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

_KEYS = (
    "source", "id", "aliases", "template_family", "parser", "context_length", "sampling",
    "kv_bits", "quantize", "quantize_group", "matryoshka_dimensions", "draft_model", "task",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """One model to serve, as the command line or the config file gives it."""

    source: str
    id: str | None = None
    aliases: frozenset[str] = frozenset()
    template_family: str | None = None
    parser: str | None = None
    context_length: int | None = None
    sampling: Mapping[str, float] = field(default_factory=dict)
    kv_bits: int | Literal["default"] | None = "default"  # "default": as --kv-bits says
    quantize: str | Literal["default"] | None = "default"  # "default": as --quantize says
    quantize_group: int | None = None  # None: as --quantize-group says
    matryoshka_dimensions: tuple[int, ...] = ()  # an embedding model's Matryoshka sizes
    draft_model: str | None = None  # None: as --draft-model says
    task: str | None = None  # "generate", "embed" or "rerank"; None: detected


def from_flags(
    models: Sequence[str], model_id: str | None, aliases: frozenset[str]
) -> list[ModelConfig]:
    """`--model` given once or more; `--model-id` and `--model-alias` name the first."""
    if model_id is not None and len(models) > 1:
        raise CliError(
            "--model-id names one model; with several --model, name each in a --config file"
        )
    first, *rest = models
    return [ModelConfig(first, model_id, aliases), *(ModelConfig(m) for m in rest)]


def read_config(path: Path) -> list[ModelConfig]:
    try:
        data = tomllib.loads(path.expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise CliError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CliError(f"--config {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise CliError(f"--config {path}: unknown key {unknown[0]!r} (only [[models]] tables)")
    tables = data.get("models")
    if not isinstance(tables, list) or not tables:
        raise CliError(f"--config {path} lists no models: add a [[models]] table with a source")
    return [_model(path, i, table) for i, table in enumerate(tables)]


def _beside(config: Path, source: str) -> str:
    """A relative path is read from the config file's folder when it exists there."""
    candidate = config.expanduser().parent / source
    if not Path(source).expanduser().is_absolute() and candidate.exists():
        return str(candidate.resolve())
    return source


def _model(path: Path, index: int, table: Any) -> ModelConfig:
    where = f"--config {path}: models[{index}]"
    if not isinstance(table, dict):
        raise CliError(f"{where} must be a table")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise CliError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
    source = table.get("source")
    if not isinstance(source, str) or not source.strip():
        raise CliError(f"{where} needs a source (an alias, a path or a Hugging Face repo id)")
    aliases = table.get("aliases", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise CliError(f"{where}.aliases must be a list of names")
    context = table.get("context_length")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int)):
        raise CliError(f"{where}.context_length must be a whole number of tokens")
    if context is not None and context < 2:
        raise CliError(f"{where}.context_length must be at least 2")
    return ModelConfig(
        source=_beside(path, source.strip()),
        id=_text(table, "id", where),
        aliases=frozenset(aliases),
        template_family=_text(table, "template_family", where),
        parser=_text(table, "parser", where),
        context_length=context,
        sampling=_sampling(table.get("sampling", {}), where),
        kv_bits=_kv_bits(table, where),
        quantize=_quantize(table, where),
        quantize_group=_quantize_group(table, where),
        matryoshka_dimensions=_dimensions(table, where),
        draft_model=_draft_source(path, table, where),
        task=_task(table, where),
    )


def _task(table: Mapping[str, Any], where: str) -> str | None:
    value = table.get("task")
    if value is not None and value not in MODEL_TASKS:
        names = ", ".join(f'"{t}"' for t in MODEL_TASKS)
        raise CliError(f"{where}.task must be {names}, not {value!r}")
    return value


def _draft_source(path: Path, table: Mapping[str, Any], where: str) -> str | None:
    source = _text(table, "draft_model", where)
    return None if source is None else _beside(path, source)


def _dimensions(table: Mapping[str, Any], where: str) -> tuple[int, ...]:
    value = table.get("matryoshka_dimensions", [])
    ok = isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
    )
    if not ok:
        raise CliError(f"{where}.matryoshka_dimensions must be a list of positive sizes")
    return tuple(value)


def _quantize(table: Mapping[str, Any], where: str) -> str | Literal["default"] | None:
    if "quantize" not in table:
        return "default"
    value = table["quantize"]
    try:
        if not isinstance(value, str):
            raise argparse.ArgumentTypeError(f"not a weight quantization: {value!r}")
        return parse_quantize(value)
    except argparse.ArgumentTypeError:
        raise CliError(f'{where}.quantize must be "q4", "q8" or "none", not {value!r}') from None


def _quantize_group(table: Mapping[str, Any], where: str) -> int | None:
    value = table.get("quantize_group")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value not in QUANTIZE_GROUPS:
        groups = ", ".join(map(str, QUANTIZE_GROUPS))
        raise CliError(f"{where}.quantize_group must be one of {groups}, not {value!r}")
    return value


def _kv_bits(table: Mapping[str, Any], where: str) -> int | Literal["default"] | None:
    if "kv_bits" not in table:
        return "default"
    value = table["kv_bits"]
    try:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise argparse.ArgumentTypeError(f"not a KV cache width: {value!r}")
        return parse_kv_bits(str(value))
    except argparse.ArgumentTypeError:
        raise CliError(f'{where}.kv_bits must be 8, 4 or "none", not {value!r}') from None


def _text(table: Mapping[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise CliError(f"{where}.{key} must be a non-empty string")
    return value.strip()


def _sampling(table: Any, where: str) -> dict[str, float]:
    if not isinstance(table, dict):
        raise CliError(f"{where}.sampling must be a table, e.g. {{ temperature = 0.7 }}")
    out: dict[str, float] = {}
    for name, value in table.items():
        valid = SAMPLING_FIELDS.get(name)
        if valid is None:
            raise CliError(
                f"{where}.sampling: unknown field {name!r} (known: {', '.join(SAMPLING_FIELDS)})"
            )
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or not valid(float(value)):
            raise CliError(f"{where}.sampling.{name}: {value!r} is out of range")
        out[name] = float(value)
    return out


def check_names(configs: Sequence[ModelConfig]) -> None:
    """Renderer and parser names exist (a typo fails at startup, not at first load)."""
    families = sorted(templates.builtin_families())
    for cfg in configs:
        if cfg.parser and cfg.parser not in parsers.names():
            raise CliError(
                f"{cfg.source}: unknown parser {cfg.parser!r}; known: {', '.join(parsers.names())}"
            )
        if cfg.template_family and cfg.template_family not in families:
            raise CliError(
                f"{cfg.source}: unknown template_family {cfg.template_family!r}; known: "
                f"{', '.join(families)}"
            )


def model_specs(
    configs: Sequence[ModelConfig], settings: EngineSettings, budget: int
) -> list[ModelSpec]:
    """Resolve every source (an alias or repo id not yet present is downloaded now, so a
    bad name fails at startup) and make each model's registry entry, with its share of
    the memory `budget` for caches."""
    check_names(configs)
    if settings.draft_model is not None and len(configs) > 1:
        raise CliError(
            "--draft-model drafts for one model; with several, give each its draft_model "
            "in a --config file"
        )
    specs: list[ModelSpec] = []
    for cfg in configs:
        path, default_id = resolve(cfg.source)
        model_id = cfg.id or default_id
        quantize = settings.quantize if cfg.quantize == "default" else cfg.quantize
        group = cfg.quantize_group or settings.quantize_group
        weights = quantized_estimate(weight_file_bytes(path), quantize, group)
        kind = _served_task(cfg, path)
        encoder = kind != "generate"
        drafting = _drafting(cfg, path, settings, encoder)
        if drafting["draft_model"] is not None:  # its weights count in the budget too
            weights += weight_file_bytes(drafting["draft_model"])
        # an encoder keeps no KV cache (its LRU of recent rows is a few MB)
        cache = 0 if encoder else cache_budget(budget, weights, len(configs))
        own = dataclasses.replace(
            settings,
            template_family=cfg.template_family or settings.template_family,
            parser=cfg.parser or settings.parser,
            memory_budget=budget,
            cache_memory_bytes=cache,
            kv_bits=settings.kv_bits if cfg.kv_bits == "default" else cfg.kv_bits,
            quantize=quantize,
            quantize_group=group,
            **drafting,
        )
        _check_quantize(path, own)
        specs.append(
            ModelSpec(
                id=model_id,
                build=_builder(path, model_id, cfg, own, encoder),
                aliases=cfg.aliases - {model_id},
                source=str(path),
                weight_bytes=weights,
                cache_bytes=cache,
                task=kind,
            )
        )
    return specs


def _served_task(cfg: ModelConfig, path: Path) -> str:
    """ "generate", "embed" or "rerank" (as /v1/models cards say), from the model's files
    and the config's `task`; a task the files contradict fails at startup."""
    try:
        found = encoder_task(path, cfg.task)
    except ValueError as exc:
        raise CliError(f"{cfg.source}: {exc}") from None
    return {None: "generate", EncoderTask.EMBED: "embed", EncoderTask.SCORE: "rerank"}[found]


def _drafting(
    cfg: ModelConfig, path: Path, settings: EngineSettings, encoder: bool
) -> dict[str, Any]:
    """The model's speculative mode and draft model (its config's draft_model, else
    --draft-model), refused at startup unless the draft's tokenizer is the model's."""
    if encoder:
        off = settings.draft_model or settings.speculative == "mtp"
        return {"speculative": "off" if off else settings.speculative,
                "draft_model": None}  # fmt: skip
    draft = resolve(cfg.draft_model)[0] if cfg.draft_model else settings.draft_model
    if draft is None:
        if settings.speculative == "mtp":
            _check_mtp(cfg, path)
        return {"speculative": settings.speculative, "draft_model": None}
    try:
        check_draft_tokenizer(path, draft)
    except (ValueError, OSError) as exc:
        raise CliError(f"{cfg.source}: draft model {draft}: {exc}") from None
    return {"speculative": "draft", "draft_model": draft}


def _check_mtp(cfg: ModelConfig, path: Path) -> None:
    """--speculative mtp on a model whose config names no multi-token-prediction layer
    fails at startup, naming it."""
    config = path / "config.json"
    layers = mtp_layers(json.loads(config.read_text())) if config.is_file() else 0
    if not layers:
        raise CliError(
            f"{cfg.source}: --speculative mtp drafts with a model's multi-token-prediction "
            "layer, and this model has none (DeepSeek-V3, GLM-4.x, Qwen3-Next and Qwen3.5 "
            "checkpoints ship one); choose --speculative lookup, trie or draft"
        )


def _check_quantize(path: Path, settings: EngineSettings) -> None:
    """--quantize (or a config's quantize) on an already quantized model fails at startup."""
    spec = weight_quantization(settings)
    if spec is None:
        return
    try:
        check_quantize(path, spec)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _builder(
    path: Path, model_id: str, cfg: ModelConfig, settings: EngineSettings, encoder: bool
) -> Callable[[], ServedModel]:
    def build() -> ServedModel:
        if encoder:
            return _build_encoder(path, model_id, cfg, settings)
        mtp = settings.speculative == "mtp"  # its MTP layer, kept only to draft with
        loaded = load(path, quantize=weight_quantization(settings), mtp=mtp)
        if cfg.context_length is not None:
            if cfg.context_length > loaded.context_length:
                log.warning(
                    "%s: context_length %d is beyond the model's own %d",
                    model_id,
                    cfg.context_length,
                    loaded.context_length,
                )
            loaded = dataclasses.replace(loaded, context_length=cfg.context_length)
        served = build_served(
            path, model_id=model_id, aliases=cfg.aliases, settings=settings, loaded=loaded
        )
        if cfg.sampling:
            served.sampling_defaults = {**served.sampling_defaults, **cfg.sampling}
        return served

    return build


def _build_encoder(
    path: Path, model_id: str, cfg: ModelConfig, settings: EngineSettings
) -> ServedModel:
    """An embedding model or cross-encoder: float weights (quantizing is for generative
    models), its input limit lowered by a config's context_length."""
    if settings.quantize is not None:
        log.info("%s: an encoder keeps its float weights (--quantize is not applied)", model_id)
    loaded = load_encoder(path, task=cfg.task)
    if cfg.context_length is not None:
        if cfg.context_length > loaded.max_length:
            log.warning(
                "%s: context_length %d is beyond the model's %d tokens an input; keeping %d",
                model_id, cfg.context_length, loaded.max_length, loaded.max_length,
            )  # fmt: skip
        else:
            loaded = dataclasses.replace(loaded, max_length=cfg.context_length)
    try:
        check_dimensions(loaded, cfg.matryoshka_dimensions)
    except ValueError as exc:
        raise CliError(f"{model_id}: {exc}") from None
    return build_encoder_served(
        path, model_id=model_id, aliases=cfg.aliases, settings=settings,
        dimensions=cfg.matryoshka_dimensions, loaded=loaded,
    )  # fmt: skip
