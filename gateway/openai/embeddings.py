"""POST /v1/embeddings, as OpenAI defines it, for embedding models (BERT-family
sentence-transformers models: runtime/load/encoder.py).

- `input`: a string, a list of strings, a list of token ids, or a list of token-id
  lists. Strings are tokenized as sentence-transformers does (special tokens added);
  token ids are the model's own vocabulary ids and are used as given (no special tokens
  added, as vLLM does). A client that sends another tokenizer's ids (LangChain's
  OpenAIEmbeddings sends tiktoken ids unless `check_embedding_ctx_length=False`) gets
  vectors of different text, or a 400 for an id beyond the vocabulary.
- Bounds, as OpenAI's: at most 2,048 inputs and 300,000 tokens a request. An input over
  the model's limit (sentence-transformers' `max_seq_length`, 256 tokens for
  all-MiniLM-L6-v2) is a 400 naming it, unless the request sets vLLM's
  `truncate_prompt_tokens` (k: keep the first k tokens, the text's end dropped and its
  closing special token kept, as sentence-transformers truncates; -1: the model's limit).
- `encoding_format`: "float" (the default) or "base64" (little-endian float32, what the
  OpenAI SDK asks for and decodes).
- `dimensions`: a 400 unless the model is configured with Matryoshka sizes (a --config
  file's `matryoshka_dimensions`) and names one of them, or names the full size. The
  vector is cut to its first `dimensions` values and, for a model that normalizes,
  normalized again.
- `usage.prompt_tokens` counts every input's tokens, special tokens included (inputs
  served from the encoder's cache of recent embeddings count too).

The embeddings are computed by the model's encoder engine in pieces between other work
(runtime/engine/encoder.py); a chat model asked for embeddings, or an embedding model
asked for chat, is a 400 naming what each serves.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
from anyio import to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.core.encode import encode, encoder_for
from gateway.core.errors import InvalidRequest
from gateway.core.http import read_model
from gateway.core.models import ServedModel
from gateway.core.preparing import prepare_off_loop
from gateway.core.with_model import with_model
from gateway.openai.wire import EmbeddingRequest
from runtime.load import LoadedEncoder
from runtime.text import EncoderTokenizer
from runtime.types import EncodeInput

MAX_INPUTS = 2048
MAX_TOKENS = 300_000
_INLINE_ROWS = 16  # a request with more inputs is tokenized, and its body written, off the loop
_INLINE_CHARACTERS = 8192

Item = str | tuple[int, ...]


@dataclass(frozen=True)
class EmbeddingPlan:
    items: tuple[Item, ...]
    base64: bool
    dimensions: int | None  # None: the model's full size
    truncate: int | None  # cut inputs to this many tokens; None: refuse a longer one


def _items(value: str | list[str] | list[int] | list[list[int]]) -> tuple[Item, ...]:
    if isinstance(value, str):
        return (value,)
    if not value:
        raise InvalidRequest("input must not be empty: send a string or a list", param="input")
    items: list[Item] = []
    ids: list[int] = []
    for v in value:  # pydantic gave one of the union's list kinds: never a mix
        if isinstance(v, int):
            ids.append(v)
        else:
            items.append(v if isinstance(v, str) else tuple(v))
    return (tuple(ids),) if ids else tuple(items)


def plan(req: EmbeddingRequest, served: ServedModel, loaded: LoadedEncoder) -> EmbeddingPlan:
    """The request checked against the model (every refusal says what to change)."""
    items = _items(req.input)
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(
            f"input has {len(items)} entries; at most {MAX_INPUTS} are allowed per request. "
            "Split it into several requests.",
            param="input",
        )
    return EmbeddingPlan(
        items=items,
        base64=req.encoding_format == "base64",
        dimensions=_dimensions(req.dimensions, served, loaded),
        truncate=_truncation(req.truncate_prompt_tokens, loaded),
    )


def _dimensions(asked: int | None, served: ServedModel, loaded: LoadedEncoder) -> int | None:
    full = loaded.width
    if asked is None or asked == full:
        return None
    sizes = served.embedding_dimensions
    if asked in sizes:
        return asked
    if sizes:
        how = f"it was trained for these sizes: {', '.join(map(str, sizes))} (and {full})"
    else:
        how = (
            "it is not configured for Matryoshka truncation (a --config file's "
            "matryoshka_dimensions lists the sizes a model was trained for); leave "
            "dimensions out"
        )
    raise InvalidRequest(
        f"The model {served.id!r} gives {full}-dimensional embeddings and cannot give "
        f"{asked}: {how}.",
        param="dimensions",
    )


def _truncation(value: int | None, loaded: LoadedEncoder) -> int | None:
    if value is None:
        return None
    if value == -1:
        return loaded.max_length
    if value == 0 or value > loaded.max_length:
        raise InvalidRequest(
            f"truncate_prompt_tokens must be -1 (the model's limit) or 1 to "
            f"{loaded.max_length} (the model's max_seq_length), not {value}",
            param="truncate_prompt_tokens",
        )
    return value


def tokenize(loaded: LoadedEncoder, plan: EmbeddingPlan) -> list[EncodeInput]:
    """Every input as token ids, checked against the model's limits (off the loop)."""
    texts = [(i, t) for i, t in enumerate(plan.items) if isinstance(t, str)]
    tok = EncoderTokenizer(loaded.tokenizer, lowercase=loaded.lowercase)
    out: list[EncodeInput | None] = [None] * len(plan.items)
    for (i, _), item in zip(texts, tok.texts([t for _, t in texts], plan.truncate), strict=True):
        _check_length(i, item.full_length, loaded, plan)
        out[i] = item.input
    vocab = loaded.model.args.vocab_size
    for i, ids in enumerate(plan.items):
        if isinstance(ids, str):
            continue
        where = _where(i, plan)
        if not ids:
            raise InvalidRequest(f"{where} has no token ids; send at least one", param="input")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"{where} holds the token id {bad}, outside this model's vocabulary "
                f"(0 to {vocab - 1}); send text, or ids from the model's own tokenizer",
                param="input",
            )
        _check_length(i, len(ids), loaded, plan)
        out[i] = EncodeInput(ids[: plan.truncate] if plan.truncate else ids)
    inputs = [x for x in out if x is not None]
    total = sum(len(x.tokens) for x in inputs)
    if total > MAX_TOKENS:
        raise InvalidRequest(
            f"The inputs are {total} tokens together; at most {MAX_TOKENS} are allowed per "
            "request. Split them into several requests.",
            param="input",
        )
    return inputs


def _where(index: int, plan: EmbeddingPlan) -> str:
    return "input" if len(plan.items) == 1 else f"input[{index}]"


def _check_length(index: int, tokens: int, loaded: LoadedEncoder, plan: EmbeddingPlan) -> None:
    limit = loaded.max_length
    if plan.truncate is None and tokens > limit:
        raise InvalidRequest(
            f"{_where(index, plan)} is {tokens} tokens; this model takes at most {limit} "
            f"tokens an input (its max_seq_length). Shorten it, or set "
            "truncate_prompt_tokens (-1: cut every input to the model's limit).",
            param="input",
            code="context_length_exceeded",
        )


def body(
    model_id: str,
    plan: EmbeddingPlan,
    values: npt.NDArray[np.float32],
    prompt_tokens: int,
    normalize: bool,
) -> dict[str, Any]:
    """OpenAI's CreateEmbeddingResponse."""
    if plan.dimensions is not None:
        values = values[:, : plan.dimensions]
        if normalize:
            norms = np.linalg.norm(values, axis=1, keepdims=True)
            values = values / np.maximum(norms, 1e-12)
    rows = np.ascontiguousarray(values, dtype="<f4")
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(row, plan.base64)}
        for i, row in enumerate(rows)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model_id, "usage": usage}


def _encoded(row: npt.NDArray[np.float32], as_base64: bool) -> str | list[float]:
    if as_base64:
        return base64.b64encode(row.tobytes()).decode("ascii")
    floats: list[float] = row.tolist()
    return floats


async def embeddings(request: Request) -> Response:
    req = await read_model(request, EmbeddingRequest)
    return await with_model(request, req.model, partial(_embed, request, req))


async def _embed(request: Request, req: EmbeddingRequest, served: ServedModel) -> Response:
    loaded = encoder_for(served, "embed", "/v1/embeddings")
    wanted = plan(req, served, loaded)
    work = partial(tokenize, loaded, wanted)
    # a few short texts tokenize in microseconds: on the loop, not through a worker
    # thread and the --max-preparing bound (a crowd of single-input requests is common)
    inline = len(wanted.items) <= _INLINE_ROWS and _characters(wanted) <= _INLINE_CHARACTERS
    inputs: Sequence[EncodeInput] = work() if inline else await prepare_off_loop(request, work)
    result = await encode(request, served, inputs)
    normalize = loaded.pooling is not None and loaded.pooling.normalize
    make = partial(
        _response, served.id, wanted, result.values, result.stats.prompt_tokens, normalize
    )
    if len(inputs) <= _INLINE_ROWS:
        return make()
    return await to_thread.run_sync(make)


def _characters(plan: EmbeddingPlan) -> int:
    return sum(len(item) for item in plan.items)


def _response(*args: Any) -> Response:
    return JSONResponse(body(*args))


ROUTES = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
]
