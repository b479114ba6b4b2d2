"""What the encoder endpoints share (/v1/embeddings, the rerank dialect): the served model
checked for the task, one encode request through its engine (the queue's 429 and 503s as
for generations, a client that leaves cancels it), and its end turned into values or the
error it stands for."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from starlette.requests import Request

from gateway.core.errors import InvalidRequest
from gateway.core.generation import Generations, failure, submit, until_disconnect
from gateway.core.http import server_settings
from gateway.core.metrics import Metrics
from gateway.core.models import ServedModel
from runtime.load import LoadedEncoder
from runtime.types import (
    Encoded,
    EncodeInput,
    EncodeRequest,
    Finished,
    FinishReason,
    GenerationStats,
)

_NONE = GenerationStats(prompt_tokens=0, completion_tokens=0)
_SERVES = {
    "generate": "generates text (chat, completions)",
    "embed": "is an embedding model (POST /v1/embeddings)",
    "rerank": "is a reranker, a cross-encoder (POST /v1/rerank)",
}


def encoder_for(served: ServedModel, task: str, endpoint: str) -> LoadedEncoder:
    """The model's encoder when it serves `task` ("embed", "rerank"); else a 400 that
    says what the model does serve."""
    loaded = served.loaded
    if served.caps.task != task or not isinstance(loaded, LoadedEncoder):
        does = _SERVES.get(served.caps.task, served.caps.task)
        wanted = "an embedding model" if task == "embed" else "a reranker (cross-encoder)"
        raise InvalidRequest(
            f"The model {served.id!r} {does}; {endpoint} needs {wanted}. Name one in "
            "`model` (GET /v1/models lists each model's task), or serve one beside it "
            "(e.g. --model all-minilm-l6-v2).",
            param="model",
            code="model_not_supported",
        )
    return loaded


class Result:
    """An encode request's rows (float32, one per input) and its token counts."""

    def __init__(self, values: npt.NDArray[np.float32], stats: GenerationStats) -> None:
        self.values = values
        self.stats = stats


async def encode(request: Request, served: ServedModel, inputs: Sequence[EncodeInput]) -> Result:
    """Run `inputs` through the model's encoder engine (see the module docstring)."""
    settings = server_settings(request)
    metrics: Metrics = request.app.state.metrics
    gens = submit(served, [EncodeRequest.of(tuple(inputs))], settings, metrics)
    done = await until_disconnect(request, gens, _ending(gens))
    seconds = time.perf_counter() - gens.handles[0].submitted_at
    if done is None:  # the client left: nobody reads an answer
        metrics.encode_done(served.caps.task, FinishReason.CANCELLED, len(inputs), _NONE, seconds)
        raise InvalidRequest("the client disconnected")
    metrics.encode_done(served.caps.task, done.reason, len(inputs), done.stats, seconds)
    error = failure(done)
    if error is not None:
        raise error
    if not isinstance(done, Encoded) or done.values is None:
        raise InvalidRequest(f"the encoder ended without values ({done.reason.value})")
    return Result(done.values, done.stats)


async def _ending(gens: Generations) -> Finished:
    async for event in gens.handles[0]:
        if isinstance(event, Finished):
            return event
    raise RuntimeError("an engine handle ended without a Finished")
