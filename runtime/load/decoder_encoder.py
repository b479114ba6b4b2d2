"""Which Qwen3 decoders are served as encoders (runtime/models/qwen3_embed.py), and what
they need beside their weights: the end-of-text token their pooling reads, and the
reranker's prompt. runtime/load/encoder.py loads them as it loads a BERT.

A qwen3 folder is
- an embedding model (Qwen3-Embedding) when its sentence-transformers modules.json lists
  a Pooling module (config.json says Qwen3ForCausalLM or Qwen3Model either way);
- a reranker scored by a head when config.json's architecture is
  Qwen3ForSequenceClassification (the seq-cls conversions of Qwen3-Reranker);
- a reranker scored by its "yes" and "no" logits (the original Qwen3-Reranker, a
  Qwen3ForCausalLM) when the folder's name, or config.json's `_name_or_path`, says
  "reranker": nothing in the checkpoint itself tells it from a chat model, and its name
  is what llama.cpp's converter reads too;
- else a chat model (runtime/load/loader.py).

A serving config's per-model `task` ("embed", "rerank" or "generate") overrides the
guess from the name: "rerank" makes any Qwen3ForCausalLM a yes/no reranker, "generate"
keeps a folder named "...reranker" a chat model; a task the checkpoint cannot do (a
sequence-classification head asked to chat or embed, "embed" without a Pooling module)
is a ValueError naming what it is.

Both kinds of reranker score a pair written into Qwen3-Reranker's prompt
(`RERANKER_PROMPT`, its model card's format with its default instruction, which a
/v1/rerank request has no field to change); the score is the probability of "yes"
(a sigmoid of the logit difference: the softmax over the two logits).

Qwen3-Embedding pools the last token, which must be the end-of-text token
(<|endoftext|>): its tokenizer.json appends it in its post-processor, as
sentence-transformers then feeds it. A tokenizer without one (a file saved before the
model's tokenizer did this, or a GGUF's vocabulary) gets one that appends it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import processors

from runtime.models import DecoderHead
from runtime.text import PairPrompt, Tokenizer

END_OF_TEXT = "<|endoftext|>"
_SEQUENCE_CLASSIFICATION = "Qwen3ForSequenceClassification"
_ST_POOLING = "sentence_transformers.models.Pooling"

RERANKER_PROMPT = PairPrompt(
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on "
        'the Query and the Instruct provided. Note that the answer can only be "yes" or '
        '"no".<|im_end|>\n<|im_start|>user\n'
    ),
    template=(
        "<Instruct>: Given a web search query, retrieve relevant passages that answer the "
        "query\n<Query>: {query}\n<Document>: {document}"
    ),
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
)


MODEL_TASKS = ("generate", "embed", "rerank")  # a serving config's `task` values


def decoder_head(
    folder: Path, config: Mapping[str, Any], task: str | None = None
) -> DecoderHead | None:
    """How the qwen3 folder is served as an encoder (see the module docstring); None for
    a chat model, or a config of another model type. `task`: the config's, or None to
    decide from the checkpoint and its name."""
    if task is not None and task not in MODEL_TASKS:
        raise ValueError(f"task {task!r} is not one of {', '.join(MODEL_TASKS)}")
    if str(config.get("model_type")) != "qwen3":
        return None
    names = [str(a) for a in config.get("architectures") or []]
    if _SEQUENCE_CLASSIFICATION in names:
        if task not in (None, "rerank"):
            raise ValueError(
                f"{folder.name} is a {_SEQUENCE_CLASSIFICATION} (a reranker's scoring head): "
                f'it serves task "rerank", not {task!r}'
            )
        return DecoderHead.SCORE
    pooled = _lists_pooling(folder / "modules.json")
    if task == "embed" and not pooled:
        raise ValueError(
            f'{folder.name}: task "embed" needs the sentence-transformers modules.json with a '
            "Pooling module that Qwen3-Embedding ships (it says how to pool)"
        )
    if task == "generate":
        return None
    if task == "rerank":
        return DecoderHead.YES_NO
    if pooled:
        return DecoderHead.NONE
    hints = (folder.name, str(config.get("_name_or_path") or ""))
    if any("reranker" in hint.lower() for hint in hints):
        return DecoderHead.YES_NO
    return None


def _lists_pooling(file: Path) -> bool:
    if not file.is_file():
        return False
    try:
        modules = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(modules, list) and any(
        isinstance(m, Mapping) and m.get("type") == _ST_POOLING for m in modules
    )


def answer_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids of the "yes" and "no" tokens a yes/no reranker's score reads."""
    yes, no = tokenizer.hf.token_to_id("yes"), tokenizer.hf.token_to_id("no")
    if yes is None or no is None:
        raise ValueError("a yes/no reranker's vocabulary needs 'yes' and 'no' tokens")
    return yes, no


def with_final_eos(tokenizer: Tokenizer) -> None:
    """Make `tokenizer` end every input with <|endoftext|> (else its EOS token), unless
    its post-processor adds a token already (Qwen3-Embedding's own appends that one)."""
    hf = tokenizer.hf
    current = hf.post_processor
    if current is not None and current.num_special_tokens_to_add(False) > 0:
        return
    token = END_OF_TEXT if hf.token_to_id(END_OF_TEXT) is not None else tokenizer.eos_token
    token_id = None if token is None else hf.token_to_id(token)
    if token is None or token_id is None:
        raise ValueError("a last-token embedding model's vocabulary needs an end-of-text token")
    eos = processors.TemplateProcessing(
        single=f"$A {token}", pair=f"$A {token} $B:1 {token}:1", special_tokens=[(token, token_id)]
    )
    hf.post_processor = eos if current is None else processors.Sequence([current, eos])
