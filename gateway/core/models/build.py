"""Builds what the server serves from a model source: load, renderer, parser, engine."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.core.capabilities import Capabilities, detect
from gateway.core.image_fetch import ImagePolicy
from gateway.core.models.encoders import build_encoder_served
from gateway.core.models.memory import MIN_CACHE_BYTES, parameter_bytes, weight_file_bytes
from gateway.core.models.served import ServedModel
from gateway.core.settings import EngineSettings
from runtime.batch import check_vocabulary
from runtime.engine import Engine, ModelRunner, RunnerSettings
from runtime.load import LoadedEncoder, LoadedModel, QuantizeSpec, is_encoder, load, load_tokenizer
from templates import (
    ControlStrings,
    MissingTemplateRenderer,
    builtin_family_for,
    control_strings,
    renderer_for,
)

if TYPE_CHECKING:
    from templates import Renderer

log = logging.getLogger(__name__)


def build_served(
    path: Path,
    *,
    model_id: str,
    aliases: frozenset[str] = frozenset(),
    settings: EngineSettings | None = None,
    loaded: object | None = None,
    make_runner: Callable[..., Any] | None = None,
) -> ServedModel:
    """Load `path` (or reuse an already `loaded` model) and wrap it for serving (an
    encoder folder: gateway/core/models/encoders.py).
    `make_runner(loaded, runner_settings)` builds the engine's runner in place of a
    ModelRunner (a distributed group's rank 0 leads its followers with its own)."""
    settings = settings or EngineSettings()
    if isinstance(loaded, LoadedEncoder) or (loaded is None and is_encoder(path)):
        return build_encoder_served(
            path,
            model_id=model_id,
            aliases=aliases,
            settings=settings,
            loaded=loaded if isinstance(loaded, LoadedEncoder) else None,
        )
    if isinstance(loaded, LoadedModel):
        model = loaded
    else:
        # the MTP layer's weights are kept only when they draft (and then count in the budget)
        mtp = settings.speculative == "mtp" and make_runner is None
        model = load(path, quantize=weight_quantization(settings), mtp=mtp)
    renderer, caps = _renderer_and_caps(model, settings, model_id)
    # a distributed group never drafts (its ranks step in lockstep): no draft model there
    drafting = settings.draft_model is not None and make_runner is None
    speculative = settings.speculative
    if (speculative == "draft" and not drafting) or (speculative == "mtp" and not _has_mtp(model)):
        speculative = "off"  # (a distributed group, or a model loaded elsewhere)
    base = RunnerSettings(
        prefill_chunk=settings.prefill_chunk,
        snapshot_interval=settings.snapshot_interval,
        max_batch=settings.max_batch,
        kv_bits=settings.kv_bits,
        speculative=speculative,
    )
    runner_settings = _runner_settings(base, model, settings, model_id)
    if make_runner is not None:
        runner = make_runner(model, runner_settings)
    else:
        draft = _draft(settings, model, model_id) if drafting else None
        runner = ModelRunner(model, runner_settings, draft=draft)
    engine = Engine(runner, max_queue=settings.max_queue, stall_seconds=settings.stall_seconds)
    log.info("%s: capabilities %s", model_id, caps.card())
    defaults = sampling_defaults(model.generation_config)
    if defaults:
        log.info("%s: sampling defaults from the model %s", model_id, defaults)
    return ServedModel(
        id=model_id,
        loaded=model,
        renderer=renderer,
        engine=engine,
        caps=caps,
        aliases=aliases,
        runner=runner,
        sampling_defaults=defaults,
        image_policy=ImagePolicy(allow_private=settings.allow_private_urls),
        controls=model_controls(model),
    )


def _has_mtp(model: LoadedModel) -> bool:
    """Whether the model was loaded with its multi-token-prediction layer."""
    head = getattr(model.model, "mtp_head", None)
    return callable(head) and head() is not None


def _draft(settings: EngineSettings, model: LoadedModel, model_id: str) -> LoadedModel:
    """The draft model (`--draft-model`), loaded as its files store it; refused unless
    its tokenizer is the served model's."""
    assert settings.draft_model is not None
    draft = load(settings.draft_model)
    check_vocabulary(model.tokenizer, draft.tokenizer)
    log.info("%s: drafting with %s", model_id, draft.name)
    return draft


def check_draft_tokenizer(path: Path, draft: Path) -> None:
    """A ValueError when the draft model's tokenizer is not the served model's (read from
    their files alone: a server refuses at startup, not at the first load)."""
    check_vocabulary(load_tokenizer(path), load_tokenizer(draft))


def model_controls(model: LoadedModel) -> ControlStrings:
    """The strings the model's tokenizer makes control tokens of: its special tokens, and
    the plain added tokens its chat format writes as markup."""
    tok = model.tokenizer
    return control_strings(tok.special_tokens, tok.added_tokens, model.chat_template)


def weight_quantization(settings: EngineSettings) -> QuantizeSpec | None:
    """The runtime's `--quantize` recipe for the settings' quantize and quantize_group."""
    if settings.quantize is None:
        return None
    return QuantizeSpec.parse(settings.quantize, settings.quantize_group)


def _renderer_and_caps(
    model: LoadedModel, settings: EngineSettings, model_id: str
) -> tuple[Renderer, Capabilities]:
    """The prompt renderer (the model's template, or a built-in one) and what the model
    can do (chat, tools, reasoning, vision), read from its config and template."""
    tok = model.tokenizer
    model_type = str(model.config.get("model_type", ""))
    renderer = renderer_for(
        model.chat_template,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        model_type=model_type,
        prefer_builtin=settings.template_family,
    )
    has_template = bool(model.chat_template and model.chat_template.strip())
    family = settings.template_family or (None if has_template else builtin_family_for(model_type))
    caps = detect(
        model_type=model_type,
        chat_template=model.chat_template if family is None else None,
        builtin_family=family,
        parser_override=settings.parser,
        vision=model.vision is not None,
    )
    if isinstance(renderer, MissingTemplateRenderer):
        log.warning("%s has no chat template; only raw completions will work", model_id)
        caps = dataclasses.replace(caps, chat=False)
    return renderer, caps


def _runner_settings(
    base: RunnerSettings, model: LoadedModel, settings: EngineSettings, model_id: str
) -> RunnerSettings:
    """`base` with the cache options the server sets (the runtime's defaults otherwise)."""
    out = base
    if settings.prefix_cache_bytes is not None:
        out = dataclasses.replace(out, prefix_cache_bytes=settings.prefix_cache_bytes)
    cache_memory = _cache_memory(model.model, settings)
    if cache_memory is not None:
        out = dataclasses.replace(out, cache_memory_bytes=cache_memory)
    if settings.prefix_cache_dir is not None:
        folder = model_folder(settings.prefix_cache_dir, model_id)
        out = dataclasses.replace(out, prefix_cache_dir=folder)
    if settings.prefix_cache_disk_bytes is not None:
        out = dataclasses.replace(out, prefix_cache_disk_bytes=settings.prefix_cache_disk_bytes)
    return out


def _cache_memory(model: object, settings: EngineSettings) -> int | None:
    """The model's cache memory: as configured, but no more than the budget leaves
    after its measured weights (a quantized file dequantized on a CPU is bigger than its
    estimate)."""
    cache = settings.cache_memory_bytes
    weights = parameter_bytes(model) if settings.memory_budget is not None else None
    if weights is not None and settings.draft_model is not None:  # the draft's files' size
        weights += weight_file_bytes(settings.draft_model)
    if settings.memory_budget is None or weights is None:
        return cache
    room = max(MIN_CACHE_BYTES, settings.memory_budget - weights)
    return room if cache is None else min(cache, room)


def model_folder(root: Path, model_id: str) -> Path:
    """The model's own folder under a shared root: its id, made a safe single name
    ("Qwen/Qwen3-8B" -> "Qwen--Qwen3-8B")."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", model_id.replace("/", "--")).strip(".-")
    return root.expanduser() / (name or "model")


# generation_config.json's sampling fields, and the values each may take (a --config
# file's `sampling` table takes the same)
SAMPLING_FIELDS: Mapping[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= 0 and v == int(v),
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: v > 0,
}


def sampling_defaults(generation: Mapping[str, Any]) -> dict[str, float]:
    """The sampling the model's authors recommend (generation_config.json, or a GGUF's
    general.sampling.*), for the fields a request leaves out.

    `do_sample: false` means greedy decoding, as in transformers (the truncation fields
    then do nothing). A missing do_sample is read as the authors' intent to sample with
    the values given, not transformers' greedy default: configs that list a temperature
    mean it. Values out of range are skipped with a warning.
    """
    if generation.get("do_sample") is False:
        return {"temperature": 0.0}
    out: dict[str, float] = {}
    for name, valid in SAMPLING_FIELDS.items():
        value = generation.get(name)
        if value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and math.isfinite(value) and valid(float(value)):
            out[name] = float(value)
        else:
            log.warning("ignoring the model's %s=%r: not a usable value", name, value)
    return out
