"""Qwen3 decoders served as encoders (runtime.models.encoder.EncoderModel): Qwen3-Embedding
(an embedding read off the last token) and Qwen3-Reranker (a relevance score read off
the last token), both causal.

The layers are qwen3's own (runtime/models/decoder.py: the same modules, the same weight
names); what differs is how a batch runs. A piece's inputs are padded on the left, so
every row ends at the last column and the last-token pooling of
runtime/models/pooling.py, or a head, reads that column. Each row's positions start at 0
at its first real token (the rotary offset of a row is minus its padding), and its
queries see only its own earlier tokens: causal attention with each row's padding
skipped. A row's states are then what the model gives the row alone.

Three heads (`Head`):

- NONE, an embedding model (`num_labels` 0): Qwen3-Embedding, pooled by the loader's
  Pooling (last token, normalized, as its sentence-transformers files say). Its query
  instruction ("Instruct: {task}\\nQuery:{query}") is part of the client's text: the
  model card prepends it to queries, not to documents, and so must the client.
- SCORE, Qwen3ForSequenceClassification (the seq-cls conversions of Qwen3-Reranker):
  `score` (hidden -> num_labels, no bias) on the last token, as transformers pools it.
- YES_NO, the original Qwen3-Reranker causal LM: the LM head's rows of the "yes" and
  "no" tokens only (`answer`: (2, hidden), yes first). `classify` gives one logit,
  logit(yes) - logit(no), so a sigmoid of it is the model card's score, the softmax of
  the two logits' "yes" entry: a probability in [0, 1].
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear

from runtime.models import qwen3
from runtime.models.base import FULL_ATTENTION
from runtime.models.decoder import DecoderLayer, LayerStack, decoder_weights
from runtime.models.encoder import attend_padded_runs
from runtime.models.rope import RoPE


class Head(str, Enum):
    NONE = "none"  # an embedding model
    SCORE = "score"  # *ForSequenceClassification's score layer
    YES_NO = "yes_no"  # a causal LM's "yes" and "no" logits


@dataclass(frozen=True)
class ModelArgs(qwen3.ModelArgs):
    head: Head = Head.NONE
    labels: int = 0  # SCORE: the score layer's outputs
    # YES_NO: the "yes" and "no" token ids (the LM head rows kept)
    answer_ids: tuple[int, int] | None = None
    pad_token_id: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        args = super().from_config(config)
        assert isinstance(args, ModelArgs)
        pad = config.get("pad_token_id")
        return replace(args, pad_token_id=int(pad) if isinstance(pad, int) else 0)

    @property
    def num_labels(self) -> int:
        if self.head is Head.SCORE:
            return self.labels
        return 1 if self.head is Head.YES_NO else 0

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def type_vocab_size(self) -> int:
        return 1  # a decoder has no token types: a pair is one prompt


def encoder_args(
    config: Mapping[str, Any],
    head: Head = Head.NONE,
    *,
    labels: int = 0,
    answer_ids: tuple[int, int] | None = None,
) -> ModelArgs:
    """The arguments for `config` (a qwen3 config.json) served with `head`."""
    if str(config.get("model_type")) != "qwen3":
        raise ValueError(f"a {config.get('model_type')!r} decoder is not served as an encoder")
    if head is Head.SCORE and labels < 1:
        raise ValueError("a sequence-classification head needs at least one label")
    if head is Head.YES_NO and answer_ids is None:
        raise ValueError("a yes/no reranker needs the ids of its 'yes' and 'no' tokens")
    args = ModelArgs.from_config(config)
    if any(kind != FULL_ATTENTION for kind in args.layer_types):
        raise ValueError("a qwen3 encoder with sliding-window layers is not supported")
    return replace(args, head=head, labels=labels, answer_ids=answer_ids)


def causal_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, padding: Sequence[int]
) -> mx.array:
    """(B, Hq, L, D) queries over the same rows' (B, Hkv, L, D) keys, causally, each row's
    left padding hidden; the padded queries' outputs are rows nobody reads.

    On the CPU each run of rows with the same padding goes through the attention
    primitive without its padding (a piece's rows come longest first: the runs are
    few), as runtime/models/encoder.py's bidirectional attention does. Elsewhere MLX's
    attention under a mask where a real query sees its row's real keys up to itself
    (and a padded one the padding before it: a finite row)."""
    out = attend_padded_runs(q, k, v, scale=scale, padding=padding, causal=True)
    if out is not None:
        return out
    if not any(padding):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    cols = mx.arange(q.shape[2], dtype=mx.int32)
    starts = mx.array(list(padding), dtype=mx.int32)[:, None, None]
    query, key = cols[None, :, None], cols[None, None, :]
    seen = (key <= query) & ((key >= starts) | (query < starts))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=seen[:, None])


def _layer(layer: DecoderLayer, x: mx.array, offsets: mx.array, padding: Sequence[int]) -> mx.array:
    """One qwen3 layer over a left-padded batch (its modules, this batch's attention)."""
    attn = layer.self_attn
    batch, length, _ = x.shape
    q, k, v = attn.project(layer.input_layernorm(x))
    q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    q, k = attn.rope(q, offsets), attn.rope(k, offsets)
    out = causal_attention(q, k, v, scale=attn.scale, padding=padding)
    h = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
    result: mx.array = h + layer.mlp(layer.post_attention_layernorm(h))
    return result


class Model(Module):
    """See the module docstring; build it with `encoder_args`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        rope = RoPE(args.rope, args.head_dim)
        self.model = LayerStack(args, lambda i: DecoderLayer(args, rope, FULL_ATTENTION))
        if args.head is Head.SCORE:
            self.score = Linear(args.hidden_size, args.labels, bias=False)
        elif args.head is Head.YES_NO:
            self.answer = Linear(args.hidden_size, 2, bias=False)

    def forward(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> mx.array:
        *_, last = self.layers(tokens, padding, token_types)
        return last

    def layers(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> Iterator[mx.array]:
        """Each layer's states; the last after the final norm (transformers'
        last_hidden_state). `token_types` must be None: a decoder has none."""
        if token_types is not None:
            raise ValueError("a decoder takes no token types")
        offsets = -mx.array(list(padding), dtype=mx.int32)  # position 0 at a row's start
        x = self.model.embed_tokens(tokens)
        count = len(self.model.layers)
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            x = _layer(layer, x, offsets, padding)
            yield self.model.norm(x) if i == count - 1 else x

    def __call__(self, tokens: mx.array, padding: Sequence[int]) -> mx.array:
        return self.forward(tokens, padding)

    def classify(self, hidden: mx.array, padding: Sequence[int]) -> mx.array:
        """(B, L, hidden) -> (B, num_labels) logits of each row's last token."""
        last = hidden[:, -1]  # left padding: every row ends at the last column
        if self.args.head is Head.SCORE:
            return self.score(last).astype(mx.float32)
        if self.args.head is Head.YES_NO:
            logits = self.answer(last).astype(mx.float32)
            return logits[:, :1] - logits[:, 1:]
        raise ValueError("this Qwen3 embedding model has no classification head")

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A checkpoint's tensors under our names: Qwen3Model's (no `model.` prefix, as
        Qwen3-Embedding ships) or Qwen3For*'s; the LM head kept only as its yes/no rows."""
        out: dict[str, mx.array] = {}
        head: mx.array | None = None
        for name, value in weights.items():
            if name == "lm_head.weight":
                head = value
                continue
            if name.startswith(("score.", "answer.")):
                out[name] = value
                continue
            out[name if name.startswith("model.") else f"model.{name}"] = value
        out = decoder_weights(out, self.args.num_layers)
        if self.args.head is Head.YES_NO and "answer.weight" not in out:
            rows = head if head is not None else out.get("model.embed_tokens.weight")
            if rows is None:
                raise ValueError("a yes/no reranker checkpoint needs its LM head or embeddings")
            assert self.args.answer_ids is not None
            out["answer.weight"] = rows[mx.array(list(self.args.answer_ids))]
        return out


def build(
    config: Mapping[str, Any],
    head: Head = Head.NONE,
    *,
    labels: int = 0,
    answer_ids: tuple[int, int] | None = None,
) -> Model:
    """A qwen3 encoder with uninitialised weights (load them through `sanitize`)."""
    return Model(encoder_args(config, head, labels=labels, answer_ids=answer_ids))
