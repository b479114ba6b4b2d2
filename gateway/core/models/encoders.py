"""Builds a served encoder: an embedding model (/v1/embeddings) or a cross-encoder
(/v1/rerank), on the same registry as chat models (load on demand, keep-alive, the one
memory budget). Its engine is the chat models' Engine around an EncoderRunner, so it
has the same queue, watchdog and health; it renders no chat (its renderer refuses, and
the routes refuse first with a message naming what it serves)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from gateway.core.capabilities import Capabilities
from gateway.core.models.served import ServedModel
from gateway.core.settings import EngineSettings
from runtime.engine import EncoderRunner, EncoderSettings, Engine
from runtime.load import EncoderTask, LoadedEncoder, load_encoder
from templates import MissingTemplateRenderer

log = logging.getLogger(__name__)

_TASKS = {EncoderTask.EMBED: "embed", EncoderTask.SCORE: "rerank"}
# requests an encoder's engine queues: more than a chat engine's (--max-queue), since a
# queued encode holds only token ids, and clients send many single-input requests at once
# (a memory index of 1,000 notes as 1,000 requests)
ENCODER_QUEUE = 4096


def build_encoder_served(
    path: Path,
    *,
    model_id: str,
    aliases: frozenset[str] = frozenset(),
    settings: EngineSettings | None = None,
    dimensions: Sequence[int] = (),
    loaded: LoadedEncoder | None = None,
) -> ServedModel:
    """Load the encoder at `path` (or wrap `loaded`) for serving. `dimensions`: the
    Matryoshka sizes requests may truncate its embeddings to."""
    settings = settings or EngineSettings()
    model = loaded if loaded is not None else load_encoder(path)
    dims = check_dimensions(model, dimensions)
    runner = EncoderRunner(model, EncoderSettings())
    queue = max(settings.max_queue, ENCODER_QUEUE)
    engine = Engine(runner, max_queue=queue, stall_seconds=settings.stall_seconds)
    task = _TASKS[model.task]
    caps = Capabilities(
        chat=False, tools=False, thinking=False, vision=False, parser="passthrough",
        family=None, task=task,
    )  # fmt: skip
    log.info(
        "%s: %s model, %d tokens an input, %s", model_id, task, model.max_length,
        f"{model.width}-dimensional embeddings" if task == "embed" else "scores pairs",
    )  # fmt: skip
    return ServedModel(
        id=model_id,
        loaded=model,
        renderer=MissingTemplateRenderer(str(model.config.get("model_type", ""))),
        engine=engine,
        caps=caps,
        aliases=aliases,
        embedding_dimensions=dims,
    )


def check_dimensions(model: LoadedEncoder, dimensions: Sequence[int]) -> tuple[int, ...]:
    """The Matryoshka sizes, sorted; a ValueError for one the model cannot give."""
    if not dimensions:
        return ()
    if model.task is not EncoderTask.EMBED:
        raise ValueError("matryoshka_dimensions is for embedding models, not a cross-encoder")
    bad = [d for d in dimensions if not 0 < d <= model.width]
    if bad:
        raise ValueError(
            f"matryoshka_dimensions {bad[0]} is out of range: the model's embeddings have "
            f"{model.width} dimensions"
        )
    return tuple(sorted(set(dimensions), reverse=True))
