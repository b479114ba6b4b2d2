"""Loading an encoder for serving: a HF folder of a BERT-family model
(runtime/models/bert.py) with sentence-transformers' files, into a `LoadedEncoder`.

What sentence-transformers reads, read the same way:

- modules.json lists the pipeline: a Transformer (the folder, or a sub-folder), a
  Pooling module (its config.json: the `pooling_mode_*` flags) and optionally Normalize.
  Any other module (Dense, LayerNorm, ...) is refused by name: serving it without would
  give different vectors.
- sentence_bert_config.json: `max_seq_length` (the tokens an input may hold, special
  tokens included; 256 for all-MiniLM-L6-v2) and `do_lower_case` (inputs lower-cased
  before tokenizing).
- Without modules.json, an embedding folder gets mean pooling, unnormalized (what
  sentence-transformers does for a plain transformers checkpoint), and the limit is the
  tokenizer's model_max_length, capped by the model's positions.

A *ForSequenceClassification checkpoint is a cross-encoder: it scores (query, document)
pairs, its activation from config.json's `sentence_transformers.activation_fn`
(sentence-transformers 4+), else a sigmoid for one label, as CrossEncoder applies.

A GGUF file of a BERT embedding model (llama.cpp's converter's output) is read too:
runtime/load/gguf/encoder.py says what it holds and what is chosen for what it does not.

Qwen3 decoders served as encoders (Qwen3-Embedding, Qwen3-Reranker; runtime/models/
qwen3_embed.py) are loaded the same way from a folder or a GGUF file:
runtime/load/decoder_encoder.py says which qwen3 folders are encoders, and
runtime/load/gguf/decoder_encoder.py which qwen3 GGUF files.

The tokenizer's own truncation and padding (tokenizer.json may set both) are turned
off: inputs are measured, refused or truncated by runtime/text/encoding.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import mlx.core as mx

from runtime.backend import trim_heap
from runtime.load.decoder_encoder import (
    RERANKER_PROMPT,
    answer_ids,
    decoder_head,
    with_final_eos,
)
from runtime.load.gguf.decoder_encoder import (
    gguf_decoder_scores,
    is_gguf_decoder_encoder,
    read_gguf_decoder_encoder,
)
from runtime.load.gguf.encoder import gguf_encoder_scores, is_gguf_encoder, read_gguf_encoder
from runtime.load.loaded import resolve_dtype
from runtime.models import (
    DecoderHead,
    EncoderModel,
    Pooling,
    build_decoder_encoder,
    build_encoder,
    is_encoder_config,
)
from runtime.models.bert import classification_labels
from runtime.text import PairPrompt, Tokenizer

log = logging.getLogger(__name__)


class EncoderTask(str, Enum):
    EMBED = "embed"  # one vector per input
    SCORE = "score"  # one relevance score per (query, document) pair


class ScoreActivation(str, Enum):
    SIGMOID = "sigmoid"
    IDENTITY = "identity"  # the head's raw logit


_ST_MODULE = "sentence_transformers.models."
_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": ScoreActivation.SIGMOID,
    "torch.nn.modules.linear.Identity": ScoreActivation.IDENTITY,
}


@dataclass(frozen=True)
class LoadedEncoder:
    model: EncoderModel
    tokenizer: Tokenizer
    config: dict[str, Any]
    task: EncoderTask
    # tokens one input (or query + document pair) may hold, special tokens included
    max_length: int
    name: str
    source: Path
    dtype: str
    pooling: Pooling | None = None  # EMBED
    activation: ScoreActivation = ScoreActivation.SIGMOID  # SCORE
    lowercase: bool = False  # sentence-transformers' do_lower_case
    # SCORE by a decoder: a pair is one prompt (no token types); None: tokenizer pairs
    pair_prompt: PairPrompt | None = None
    load_seconds: float = 0.0
    quantized: bool = False
    vision: None = None  # an encoder reads text only

    @property
    def context_length(self) -> int:
        return self.max_length

    @property
    def weight_format(self) -> str:
        return self.dtype

    @property
    def width(self) -> int:
        """An embedding's size (EMBED); the head's outputs (SCORE)."""
        args = self.model.args
        if self.pooling is None:
            return args.num_labels
        return self.pooling.width(args.hidden_size)


def is_encoder(source: str | Path, task: str | None = None) -> bool:
    """Whether `source` is a folder holding an encoder (config.json's model_type), or a
    GGUF file of one; `task` as encoder_task."""
    return encoder_task(source, task) is not None


_TASK_NAMES = {EncoderTask.EMBED: "embed", EncoderTask.SCORE: "rerank", None: "generate"}


def encoder_task(source: str | Path, task: str | None = None) -> EncoderTask | None:
    """What `source` serves, read from its config (or a GGUF's head) without its weights:
    None for a chat model. `task` ("generate", "embed" or "rerank"), a serving config's,
    decides where the checkpoint leaves it open (runtime/load/decoder_encoder.py) and is
    a ValueError where the checkpoint says otherwise."""
    path = Path(source).expanduser()
    found: EncoderTask | None = None
    if path.is_file():
        if is_gguf_decoder_encoder(path):
            found = EncoderTask.SCORE if gguf_decoder_scores(path) else EncoderTask.EMBED
        elif is_gguf_encoder(path):
            found = EncoderTask.SCORE if gguf_encoder_scores(path) else EncoderTask.EMBED
    else:
        config = _config_of(path)
        head = decoder_head(path, config, task) if config is not None else None
        if head is not None:
            return EncoderTask.EMBED if head is DecoderHead.NONE else EncoderTask.SCORE
        if config is not None and str(config.get("model_type")) == "qwen3":
            return None  # a chat model, `task` checked by decoder_head
        if config is not None and is_encoder_config(config):
            labelled = classification_labels(config) > 0
            found = EncoderTask.SCORE if labelled else EncoderTask.EMBED
    if task is not None and task != _TASK_NAMES[found]:
        raise ValueError(
            f'{path.name} serves task "{_TASK_NAMES[found]}", not {task!r} (the config\'s '
            "task chooses only for a Qwen3 decoder: a Qwen3-Reranker or -Embedding folder)"
        )
    return found


def _config_of(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def load_encoder(
    source: str | Path, *, dtype: str | None = None, task: str | None = None
) -> LoadedEncoder:
    """Load an encoder folder or GGUF file (see the module docstring); `dtype` as
    runtime.load.load; `task` a serving config's, as encoder_task."""
    started = time.perf_counter()
    path = Path(source).expanduser()
    dtype_name, mx_dtype = resolve_dtype(dtype)
    if task is not None:
        encoder_task(path, task)  # a ValueError where the file says otherwise
    if path.is_file():
        loaded = _from_gguf(path, dtype_name, mx_dtype)
    else:
        loaded = _from_folder(path, dtype_name, mx_dtype, task)
    trim_heap()
    seconds = time.perf_counter() - started
    log.info("loaded encoder %s in %.1f s (%s, %s)", path, seconds, loaded.task.value, dtype_name)
    return replace(loaded, load_seconds=seconds)


def _with_weights(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    dtype: mx.Dtype,
    model: EncoderModel | None = None,
) -> EncoderModel:
    model = build_encoder(config) if model is None else model
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    weights.clear()
    mx.eval(model.parameters())
    return model


def _from_gguf(path: Path, dtype_name: str, dtype: mx.Dtype) -> LoadedEncoder:
    if is_gguf_decoder_encoder(path):
        return _from_decoder_gguf(path, dtype_name, dtype)
    parts = read_gguf_encoder(path)
    weights = {name: mx.array(value) for name, value in parts.weights.items()}
    model = _with_weights(parts.config, weights, dtype)
    tokenizer = parts.tokenizer
    tokenizer.hf.no_truncation()
    tokenizer.hf.no_padding()
    if parts.pooling is None:  # a cross-encoder
        return LoadedEncoder(
            model, tokenizer, parts.config, EncoderTask.SCORE, model.args.max_positions,
            path.stem, path, dtype_name, activation=_activation(parts.config, model.args.num_labels),
        )  # fmt: skip
    return LoadedEncoder(
        model, tokenizer, parts.config, EncoderTask.EMBED, model.args.max_positions, path.stem,
        path, dtype_name, pooling=parts.pooling,
    )  # fmt: skip


def _from_folder(
    folder: Path, dtype_name: str, dtype: mx.Dtype, task: str | None = None
) -> LoadedEncoder:
    config = _read_json(folder / "config.json")
    if config is None:
        raise FileNotFoundError(f"{folder} has no config.json")
    head = decoder_head(folder, config, task)
    if head is not None:
        return _from_decoder_folder(folder, config, head, dtype_name, dtype)
    model = _with_weights(config, _read_weights(folder), dtype)
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.hf.no_truncation()
    tokenizer.hf.no_padding()
    limit = _default_limit(folder, model)
    if model.args.num_labels:
        return LoadedEncoder(
            model, tokenizer, config, EncoderTask.SCORE, limit, folder.name, folder, dtype_name,
            activation=_activation(config, model.args.num_labels),
        )  # fmt: skip
    return _embedding(folder, model, tokenizer, config, limit, dtype_name)


def _from_decoder_folder(
    folder: Path, config: dict[str, Any], head: DecoderHead, dtype_name: str, dtype: mx.Dtype
) -> LoadedEncoder:
    """A Qwen3 embedding model or reranker folder (runtime/load/decoder_encoder.py)."""
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.hf.no_truncation()
    tokenizer.hf.no_padding()
    built = build_decoder_encoder(
        config, head, labels=classification_labels(config),
        answer_ids=answer_ids(tokenizer) if head is DecoderHead.YES_NO else None,
    )  # fmt: skip
    model = _with_weights(config, _read_weights(folder), dtype, built)
    limit = _default_limit(folder, model)
    if head is DecoderHead.NONE:
        with_final_eos(tokenizer)
        return _embedding(folder, model, tokenizer, config, limit, dtype_name)
    return LoadedEncoder(
        model, tokenizer, config, EncoderTask.SCORE, limit, folder.name, folder, dtype_name,
        activation=_activation(config, model.args.num_labels), pair_prompt=RERANKER_PROMPT,
    )  # fmt: skip


def _from_decoder_gguf(path: Path, dtype_name: str, dtype: mx.Dtype) -> LoadedEncoder:
    parts = read_gguf_decoder_encoder(path)
    tokenizer = parts.tokenizer
    tokenizer.hf.no_truncation()
    tokenizer.hf.no_padding()
    yes_no = answer_ids(tokenizer) if parts.head is DecoderHead.YES_NO else None
    built = build_decoder_encoder(parts.config, parts.head, answer_ids=yes_no)
    weights = {name: mx.array(value) for name, value in parts.weights.items()}
    model = _with_weights(parts.config, weights, dtype, built)
    limit = model.args.max_positions
    if parts.pooling is None:
        return LoadedEncoder(
            model, tokenizer, parts.config, EncoderTask.SCORE, limit, path.stem, path,
            dtype_name, pair_prompt=RERANKER_PROMPT,
        )  # fmt: skip
    with_final_eos(tokenizer)
    return LoadedEncoder(
        model, tokenizer, parts.config, EncoderTask.EMBED, limit, path.stem, path, dtype_name,
        pooling=parts.pooling,
    )  # fmt: skip


def _embedding(
    folder: Path,
    model: EncoderModel,
    tokenizer: Tokenizer,
    config: dict[str, Any],
    limit: int,
    dtype: str,
) -> LoadedEncoder:
    modules = _read_json(folder / "modules.json", list)
    if modules is None:
        log.warning("%s has no modules.json: mean pooling, not normalized", folder)
        pooling, lowercase = Pooling(), False
    else:
        pooling, bert_config = _pipeline(folder, modules)
        limit = min(int(bert_config.get("max_seq_length") or limit), model.args.max_positions)
        lowercase = bool(bert_config.get("do_lower_case", False))
    return LoadedEncoder(
        model, tokenizer, config, EncoderTask.EMBED, limit, folder.name, folder, dtype,
        pooling=pooling, lowercase=lowercase,
    )  # fmt: skip


def _pipeline(folder: Path, modules: list[Any]) -> tuple[Pooling, Mapping[str, Any]]:
    """The Pooling (with Normalize) and the Transformer's sentence_bert_config.json."""
    pooling_config: Mapping[str, Any] | None = None
    bert_config: Mapping[str, Any] = {}
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, Mapping) else ""
        path = folder / str(module.get("path", "")) if isinstance(module, Mapping) else folder
        name = kind.removeprefix(_ST_MODULE)
        if name == "Transformer":
            bert_config = _read_json(path / "sentence_bert_config.json") or {}
        elif name == "Pooling":
            pooling_config = _read_json(path / "config.json")
            if pooling_config is None:
                raise ValueError(f"{path} has no config.json for its Pooling module")
        elif name == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{folder}: the sentence-transformers module {kind!r} is not supported "
                "(Transformer, Pooling and Normalize are)"
            )
    if pooling_config is None:
        raise ValueError(f"{folder}: modules.json lists no Pooling module")
    return Pooling.from_config(pooling_config, normalize=normalize), bert_config


def _activation(config: Mapping[str, Any], labels: int) -> ScoreActivation:
    st = config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, Mapping) else None
    if name is not None:
        if name not in _ACTIVATIONS:
            raise ValueError(f"cross-encoder activation_fn {name!r} is not supported")
        return _ACTIVATIONS[str(name)]
    if labels != 1:
        raise ValueError(
            f"a cross-encoder with {labels} labels is a classifier; relevance scores need one"
        )
    return ScoreActivation.SIGMOID


def _default_limit(folder: Path, model: EncoderModel) -> int:
    """tokenizer_config.json's model_max_length where it is sane, capped by positions."""
    positions = model.args.max_positions
    value = (_read_json(folder / "tokenizer_config.json") or {}).get("model_max_length")
    if isinstance(value, int) and 0 < value < positions:
        return value
    return positions


def _read_weights(folder: Path) -> dict[str, mx.array]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        loaded = mx.load(str(file))
        if not isinstance(loaded, dict):
            raise ValueError(f"{file}: expected a safetensors mapping")
        weights.update(loaded)
    return weights


def _read_json(file: Path, kind: type = dict) -> Any:
    """A JSON file's value when it is a `kind`; None when the file is missing."""
    if not file.is_file():
        return None
    value = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(value, kind):
        raise ValueError(f"{file} is not a JSON {kind.__name__}")
    return value
