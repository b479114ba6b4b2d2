"""BERT-family encoders: bert, roberta and xlm-roberta (the transformers under most
sentence-transformers embedding models and cross-encoder rerankers), with or without a
sequence-classification head.

RoBERTa and XLM-RoBERTa differ from BERT in positions only: they count from
padding_idx + 1, and a padding token sits at padding_idx (create_position_ids_from_input_ids
in transformers); they have one token type. Their classification head is a tanh dense
layer on <s> followed by out_proj; BERT's is its pooler (tanh dense on [CLS]) followed
by the classifier.

Weights keep transformers' names up to the layer; sanitize maps each layer's nested
names (attention.self.query, attention.output.LayerNorm, ...) onto flat ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.activations import gelu, gelu_approx, relu
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import LayerNorm

from runtime import kernels as cpu_kernels
from runtime.models.encoder import bidirectional_attention, first_token

log = logging.getLogger(__name__)

ROBERTA_TYPES = frozenset({"roberta", "xlm-roberta", "camembert"})

# erf(x) as Eigen's rational approximation (odd numerator, even denominator in x^2; the
# input clamped to [-4, 4], where float32 erf is +-1): within 5e-7 of the exact erf, about
# MLX's own, but made of multiplies and adds, which MLX's CPU backend vectorizes (its erf
# is a scalar loop: the exact GELU took half of a MiniLM forward)
_ERF_NUMERATOR = (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
    -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02,
)  # fmt: skip
_ERF_DENOMINATOR = (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
    -7.37332916720468e-03, -1.42647390514189e-02,
)  # fmt: skip


def _erf_gelu(x: mx.array) -> mx.array:
    """The exact (erf) GELU, x * (1 + erf(x / sqrt 2)) / 2, with the erf above."""
    z = mx.clip(x * 0.7071067811865476, -4.0, 4.0)
    z2 = z * z
    p = mx.array(_ERF_NUMERATOR[0], dtype=x.dtype)
    for c in _ERF_NUMERATOR[1:]:
        p = p * z2 + c
    q = mx.array(_ERF_DENOMINATOR[0], dtype=x.dtype)
    for c in _ERF_DENOMINATOR[1:]:
        q = q * z2 + c
    return 0.5 * x * (1.0 + z * p / q)


class _Gelu:
    """The CPU kernels' GELU (runtime/kernels/kernels.c: the same erf, on every core)
    where it runs. Else `_erf_gelu` compiled into one fused kernel, run on blocks of
    `ROWS` rows: MLX's fused CPU kernels are single-threaded loops, about 3x faster per
    element on a block that stays in cache than on a whole piece's (2,000 x 1,536)
    activations; and the compiled function is traced for at most `ROWS` shapes.
    Uncompiled where MLX cannot compile (its CPU backend builds fused kernels with the
    system's C++ compiler); a shapeless compile would trace once, but its kernel runs no
    faster than the unfused ops."""

    ROWS = 32

    def __init__(self) -> None:
        self._compiled: Callable[[mx.array], mx.array] | None = mx.compile(_erf_gelu)

    def __call__(self, x: mx.array) -> mx.array:
        out = cpu_kernels.gelu_erf(x)  # the same erf on all cores, where it runs
        if out is not None:
            return out
        if self._compiled is not None:
            try:
                return self._blocks(self._compiled, x)
            except (RuntimeError, ValueError) as exc:
                log.warning("the fused GELU does not compile here (%s); running it unfused", exc)
                self._compiled = None
        return _erf_gelu(x)

    def _blocks(self, fused: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        parts = [fused(rows[i : i + self.ROWS]) for i in range(0, count, self.ROWS)]
        out = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return out.reshape(x.shape)


_ACTIVATIONS: Mapping[str, Callable[[mx.array], mx.array]] = {
    "gelu": gelu,
    "gelu_new": gelu_approx,
    "gelu_pytorch_tanh": gelu_approx,
    "relu": relu,
}

# transformers' layer names -> ours
_LAYER_NAMES = (
    ("attention.self.query.", "query."),
    ("attention.self.key.", "key."),
    ("attention.self.value.", "value."),
    ("attention.output.dense.", "attn_out."),
    ("attention.output.LayerNorm.", "attn_norm."),
    ("intermediate.dense.", "up."),
    ("output.dense.", "down."),
    ("output.LayerNorm.", "out_norm."),
)


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    num_labels: int  # 0: no classification head (an embedding model)

    @property
    def roberta(self) -> bool:
        return self.model_type in ROBERTA_TYPES

    @property
    def position_offset(self) -> int:
        """The position of an input's first token (RoBERTa: padding_idx + 1)."""
        return self.pad_token_id + 1 if self.roberta else 0

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is not supported (absolute only)")
        act = str(config.get("hidden_act", "gelu"))
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}"
            )
        model_type = str(config["model_type"])
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 512)),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            pad_token_id=int(
                config.get("pad_token_id") or (1 if model_type in ROBERTA_TYPES else 0)
            ),
            num_labels=classification_labels(config),
        )


def classification_labels(config: Mapping[str, Any]) -> int:
    """The head's outputs for a *ForSequenceClassification checkpoint (transformers:
    len(id2label), else num_labels, else 2); 0 for any other architecture."""
    names = config.get("architectures") or []
    if not any(str(n).endswith("ForSequenceClassification") for n in names):
        return 0
    labels = config.get("id2label")
    if isinstance(labels, Mapping) and labels:
        return len(labels)
    return int(config.get("num_labels", 2))


class Embeddings(Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.word_embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, tokens: mx.array, positions: mx.array, types: mx.array) -> mx.array:
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(types))


class Layer(Module):
    """Post-norm attention and MLP, as BERT has them."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dims, hidden = args.hidden_size, args.intermediate_size
        self.heads = args.num_heads
        self.scale = (dims // args.num_heads) ** -0.5
        self.query = Linear(dims, dims)
        self.key = Linear(dims, dims)
        self.value = Linear(dims, dims)
        self.attn_out = Linear(dims, dims)
        self.attn_norm = LayerNorm(dims, eps=args.layer_norm_eps)
        self.up = Linear(dims, hidden)
        self.down = Linear(hidden, dims)
        self.out_norm = LayerNorm(dims, eps=args.layer_norm_eps)
        self._act = _Gelu() if args.hidden_act == "gelu" else _ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array, padding: Sequence[int]) -> mx.array:
        batch, length, dims = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(batch, length, self.heads, -1).transpose(0, 2, 1, 3)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        out = bidirectional_attention(q, k, v, scale=self.scale, padding=padding)
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, dims)
        x = self.attn_norm(x + self.attn_out(out))
        return self.out_norm(x + self.down(self._act(self.up(x))))


class Encoder(Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layer = [Layer(args) for _ in range(args.num_layers)]


class BertHead(Module):
    """BERT's pooler (tanh dense on [CLS]) and classifier."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.pooler = Linear(args.hidden_size, args.hidden_size)
        self.classifier = Linear(args.hidden_size, args.num_labels)

    def __call__(self, first: mx.array) -> mx.array:
        return self.classifier(mx.tanh(self.pooler(first)))


class RobertaHead(Module):
    """RoBERTa's classification head: tanh dense on <s>, then out_proj."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense = Linear(args.hidden_size, args.hidden_size)
        self.out_proj = Linear(args.hidden_size, args.num_labels)

    def __call__(self, first: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first)))


class Model(Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.head: BertHead | RobertaHead | None = None
        if args.num_labels:
            self.head = RobertaHead(args) if args.roberta else BertHead(args)

    def positions(self, tokens: mx.array, padding: Sequence[int]) -> mx.array:
        """Each token's position, counted from the row's first token."""
        if self.args.roberta:
            # transformers counts the non-padding tokens (padding sits at padding_idx)
            real = (tokens != self.args.pad_token_id).astype(mx.int32)
            return mx.cumsum(real, axis=1) * real + self.args.pad_token_id
        starts = mx.array(list(padding), dtype=mx.int32)[:, None]
        return mx.maximum(mx.arange(tokens.shape[1], dtype=mx.int32)[None, :] - starts, 0)

    def forward(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> mx.array:
        *_, last = self.layers(tokens, padding, token_types)
        return last

    def layers(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> Iterator[mx.array]:
        types = mx.zeros_like(tokens) if token_types is None else token_types
        x = self.embeddings(tokens, self.positions(tokens, padding), types)
        for layer in self.encoder.layer:
            x = layer(x, padding)
            yield x

    def __call__(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> mx.array:
        return self.forward(tokens, padding, token_types)

    def classify(self, hidden: mx.array, padding: Sequence[int]) -> mx.array:
        if self.head is None:
            raise ValueError(f"this {self.args.model_type} checkpoint has no classification head")
        return self.head(first_token(hidden, padding))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            key = _our_name(name, self.args)
            if key is not None:
                out[key] = value
        return out


def _our_name(name: str, args: ModelArgs) -> str | None:
    """Our parameter name for a checkpoint's tensor; None for what we do not use (the
    position-id buffers, an embedding model's unused pooler, a masked-LM head)."""
    for prefix in ("bert.", "roberta.", "model."):
        name = name.removeprefix(prefix)
    if name.endswith(("position_ids", "token_type_ids")) or name.startswith(("cls.", "lm_head.")):
        return None
    if name.startswith("pooler."):
        use = args.num_labels and not args.roberta
        return "head.pooler." + name.removeprefix("pooler.dense.") if use else None
    if name.startswith("classifier."):
        rest = name.removeprefix("classifier.")
        return "head." + (rest if args.roberta else "classifier." + rest)
    if name.startswith("encoder.layer."):
        index, _, rest = name.removeprefix("encoder.layer.").partition(".")
        for theirs, ours in _LAYER_NAMES:
            if rest.startswith(theirs):
                return f"encoder.layer.{index}.{ours}{rest.removeprefix(theirs)}"
    return name
